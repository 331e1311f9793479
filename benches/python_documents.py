"""Variable-length documents from Python: stokehold's DocumentLoader against PyTorch's
DataLoader over the same Megatron indexed dataset, read the way Megatron-Core's
``IndexedDataset`` reads it (``np.frombuffer`` over memory maps of ``.idx`` and
``.bin``, one document per ``__getitem__``), padded to ``max_len`` by a collate
function. Same files, batch size, worker count and full shuffle; warm page cache; one
process; the figure is a ratio.

    pip install ./bindings/python torch
    python benches/python_documents.py [--dir data/documents] [--docs 200000] [--json FILE]

The set is written once (long-tailed lengths, 16 to 4,000 ``uint16`` tokens).
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import stokehold

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


def padder(max_len: int):
    def collate(docs):
        out = np.zeros((len(docs), max_len), dtype=np.uint16)
        lens = np.empty(len(docs), dtype=np.int64)
        for k, d in enumerate(docs):
            n = min(len(d), max_len)
            out[k, :n] = d[:n]
            lens[k] = n
        return torch.from_numpy(out), torch.from_numpy(lens)

    return collate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="data/documents")
    p.add_argument("--docs", type=int, default=200_000)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    prefix = Path(args.dir) / "set_text_document"
    if not prefix.with_suffix(".idx").exists():
        write(prefix, args.docs)
    for ext in (".bin", ".idx"):
        with open(prefix.with_suffix(ext), "rb") as f:
            while f.read(1 << 24):
                pass

    ours = stokehold.DocumentLoader(prefix, max_len=args.max_len, batch_size=args.batch,
                                    shuffle="full", workers=args.workers)
    peer = DataLoader(Megatron(prefix), batch_size=args.batch, shuffle=True,
                      num_workers=args.workers, persistent_workers=True, prefetch_factor=4,
                      collate_fn=padder(args.max_len))
    n = len(Megatron(prefix))

    def time_ours(epoch: int) -> float:
        t = time.perf_counter()
        for b in ours.epoch(epoch):
            torch.from_dlpack(b["tokens"]), torch.from_dlpack(b["len"])
        return time.perf_counter() - t

    def time_peer() -> float:
        t = time.perf_counter()
        for _tokens, _lens in peer:
            pass
        return time.perf_counter() - t

    # Alternating, best of each: the machine's noise hits both.
    a, b = [], []
    for r in range(args.reps):
        a.append(time_ours(r))
        b.append(time_peer())
    rows = {
        "documents": n,
        "max_len": args.max_len,
        "batch": args.batch,
        "workers": args.workers,
        "stokehold_samples_per_s": n / min(a),
        "pytorch_samples_per_s": n / min(b),
    }
    rows["ratio"] = rows["stokehold_samples_per_s"] / rows["pytorch_samples_per_s"]
    print(f"{n} documents, max_len {args.max_len}, batch {args.batch}, {args.workers} workers")
    print(f"stokehold DocumentLoader  {rows['stokehold_samples_per_s']:>12,.0f} samples/s")
    print(f"PyTorch DataLoader        {rows['pytorch_samples_per_s']:>12,.0f} samples/s")
    print(f"ratio                     {rows['ratio']:>12.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
