"""Variable-length documents from Python: stokehold's DocumentLoader against PyTorch's
DataLoader over the same Megatron indexed dataset, read the way Megatron-Core's
``IndexedDataset`` reads it (``np.frombuffer`` over memory maps of ``.idx`` and
``.bin``, one document per ``__getitem__``), padded to ``max_len`` by a collate
function; then packed, stokehold's PackedLoader against a Dataset that cuts windows of
``seq_len + 1`` tokens from the concatenated documents with their positions
(``np.searchsorted`` over the documents' starts, one window per ``__getitem__``). Same
files, batch size, worker count and full shuffle; warm page cache; one process; the
figures are ratios.

    pip install ./bindings/python torch
    python benches/python_documents.py [--dir data/documents] [--docs 200000] [--json FILE]
        [--max-len 1024] [--seq-len 1024]

The set is written once (long-tailed lengths, 16 to 4,000 ``uint16`` tokens).
"""

import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import stokehold
from python_loaders import options, read_once  # this directory is on sys.path when run as a script

HEADER = b"MMIDIDX\x00\x00"


def write(prefix: Path, docs: int) -> None:
    """A Megatron indexed dataset as Megatron-Core's IndexedDatasetBuilder writes one."""
    rng = np.random.default_rng(0)
    u = rng.random(docs)
    lengths = (16.0 / (1.0 - u * 0.996)).astype(np.int32)
    tokens = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.uint16)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * 2)])
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(prefix.with_suffix(".bin"))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(HEADER + np.uint64(1).tobytes() + np.uint8(8).tobytes())
        f.write(np.uint64(docs).tobytes() + np.uint64(docs + 1).tobytes())
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes())
        f.write(np.arange(docs + 1, dtype=np.int64).tobytes())


class Megatron(Dataset):
    """One document per item, as Megatron-Core's IndexedDataset.get reads it."""

    def __init__(self, prefix: Path):
        self.prefix = prefix
        idx = np.memmap(prefix.with_suffix(".idx"), mode="r", order="C")
        buf = memoryview(idx)
        n = int(np.frombuffer(buf, dtype=np.uint64, count=1, offset=18)[0])
        self.lengths = np.frombuffer(buf, dtype=np.int32, count=n, offset=34)
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=34 + 4 * n)
        self.bin = memoryview(np.memmap(prefix.with_suffix(".bin"), mode="r", order="C"))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        n, at = int(self.lengths[i]), int(self.pointers[i])
        return np.frombuffer(self.bin, dtype=np.uint16, count=n, offset=at)


class PackedMegatron(Megatron):
    """Windows of ``seq_len + 1`` tokens of the documents back to back, with each token's
    position in its document, one window per item."""

    def __init__(self, prefix: Path, seq_len: int):
        super().__init__(prefix)
        self.seq_len = seq_len
        self.starts = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1] - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        end = s + self.seq_len + 1
        d = int(np.searchsorted(self.starts, s, side="right")) - 1
        tokens, positions = [], []
        while s < end:
            skip = s - int(self.starts[d])
            take = min(int(self.starts[d + 1]), end) - s
            at = int(self.pointers[d]) + 2 * skip
            tokens.append(np.frombuffer(self.bin, dtype=np.uint16, count=take, offset=at))
            positions.append(np.arange(skip, skip + take, dtype=np.int32))
            s += take
            d += 1
        return np.concatenate(tokens), np.concatenate(positions)


def padder(max_len: int, dtype=np.uint16, document=lambda d: d):
    """A collate function padding each sample's ``document(sample)`` to ``max_len``."""

    def collate(docs):
        out = np.zeros((len(docs), max_len), dtype=dtype)
        lens = np.empty(len(docs), dtype=np.int64)
        for k, d in enumerate(map(document, docs)):
            n = min(len(d), max_len)
            out[k, :n] = d[:n]
            lens[k] = n
        return torch.from_numpy(out), torch.from_numpy(lens)

    return collate


def main() -> None:
    args = options(__doc__, dir="data/documents", docs=200_000, max_len=1024, seq_len=1024,
                   batch=32, workers=2, reps=3)
    prefix = Path(args.dir) / "set_text_document"
    if not prefix.with_suffix(".idx").exists():
        write(prefix, args.docs)
    read_once(prefix.with_suffix(ext) for ext in (".bin", ".idx"))

    ours = stokehold.DocumentLoader(prefix, max_len=args.max_len, batch_size=args.batch,
                                    shuffle="full", workers=args.workers)
    peer = DataLoader(Megatron(prefix), batch_size=args.batch, shuffle=True,
                      num_workers=args.workers, persistent_workers=True, prefetch_factor=4,
                      collate_fn=padder(args.max_len))
    n = len(Megatron(prefix))
    a, b = race(ours, peer, ("tokens", "len"), args.reps)
    rows = {
        "documents": n,
        "max_len": args.max_len,
        "batch": args.batch,
        "workers": args.workers,
        "stokehold_samples_per_s": n / a,
        "pytorch_samples_per_s": n / b,
    }
    rows["ratio"] = rows["stokehold_samples_per_s"] / rows["pytorch_samples_per_s"]
    print(f"{n} documents, max_len {args.max_len}, batch {args.batch}, {args.workers} workers")
    print(f"stokehold DocumentLoader  {rows['stokehold_samples_per_s']:>12,.0f} samples/s")
    print(f"PyTorch DataLoader        {rows['pytorch_samples_per_s']:>12,.0f} samples/s")
    print(f"ratio                     {rows['ratio']:>12.1f}x")
    del ours, peer

    packed = PackedMegatron(prefix, args.seq_len)
    ours = stokehold.PackedLoader(prefix, seq_len=args.seq_len, batch_size=args.batch,
                                  windows="consecutive", shuffle="full", workers=args.workers)
    peer = DataLoader(packed, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                      persistent_workers=True, prefetch_factor=4)
    n = len(packed)
    assert len(ours) == -(-n // args.batch)  # the same windows
    a, b = race(ours, peer, ("tokens", "positions"), args.reps)
    rows["seq_len"] = args.seq_len
    rows["packed_windows"] = n
    rows["packed_stokehold_samples_per_s"] = n / a
    rows["packed_pytorch_samples_per_s"] = n / b
    rows["packed_ratio"] = n / a / (n / b)
    print(f"\n{n} packed windows of seq_len {args.seq_len} (tokens and positions)")
    print(f"stokehold PackedLoader    {n / a:>12,.0f} samples/s")
    print(f"PyTorch DataLoader        {n / b:>12,.0f} samples/s")
    print(f"ratio                     {rows['packed_ratio']:>12.1f}x")
    # What packing costs: the same windows of the same .bin (a raw uint16 stream) drained
    # in Rust, with positions (PackedLoader) and without (TokenLoader).
    plain = stokehold.TokenLoader(prefix.with_suffix(".bin"), seq_len=args.seq_len,
                                  batch_size=args.batch, windows="consecutive",
                                  shuffle="full", workers=args.workers)
    # And with the documents in another order each epoch (each epoch's first gather
    # makes the order's table, timed with the epoch).
    shuffled = stokehold.PackedLoader(prefix, seq_len=args.seq_len, batch_size=args.batch,
                                      windows="consecutive", shuffle="full",
                                      workers=args.workers, shuffle_documents=True)
    assert len(plain) == len(ours) == len(shuffled)
    drained = {"packed": [], "tokens": [], "shuffled": []}
    for r in range(args.reps):
        for name, loader in (("packed", ours), ("tokens", plain), ("shuffled", shuffled)):
            samples, secs = loader._raw.drain(r)
            drained[name].append(samples / secs)
    rows["packed_rust_samples_per_s"] = max(drained["packed"])
    rows["tokens_rust_samples_per_s"] = max(drained["tokens"])
    rows["packed_shuffled_rust_samples_per_s"] = max(drained["shuffled"])
    share = rows["packed_rust_samples_per_s"] / rows["tokens_rust_samples_per_s"]
    rows["packed_over_tokens"] = share
    moved = rows["packed_shuffled_rust_samples_per_s"] / rows["packed_rust_samples_per_s"]
    rows["shuffled_over_packed"] = moved
    print(f"drained in Rust: PackedLoader {rows['packed_rust_samples_per_s']:,.0f} windows/s, "
          f"TokenLoader over the same .bin {rows['tokens_rust_samples_per_s']:,.0f} ({share:.2f}x), "
          f"PackedLoader with shuffled documents "
          f"{rows['packed_shuffled_rust_samples_per_s']:,.0f} ({moved:.2f}x the stored order)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def race(ours, peer, columns, reps: int):
    """The best epoch time of each of two loaders, run alternately (the machine's noise
    hits both); stokehold's batches are handed to torch as a training loop would."""

    def time_ours(epoch: int) -> float:
        t = time.perf_counter()
        for b in ours.epoch(epoch):
            [torch.from_dlpack(b[c]) for c in columns]
        return time.perf_counter() - t

    def time_peer() -> float:
        t = time.perf_counter()
        for _batch in peer:
            pass
        return time.perf_counter() - t

    a, b = [], []
    for r in range(reps):
        a.append(time_ours(r))
        b.append(time_peer())
    return min(a), min(b)


if __name__ == "__main__":
    main()
