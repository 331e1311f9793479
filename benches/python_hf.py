"""A Hugging Face ``datasets`` table from Python: stokehold's DocumentLoader and
PackedLoader reading the table's ``.arrow`` shards in place, against PyTorch's
DataLoader over the same table as ``datasets`` serves it (``with_format("numpy")``,
batched ``__getitems__``, a collate function that pads to ``max_len``; and for packing,
windows cut from the documents back to back as a ``group_texts`` map would, then
served the same way). Same shards, batch size, worker count and full shuffle; warm page
cache; one process; the figures are ratios.

    pip install ./bindings/python torch datasets
    python benches/python_hf.py [--dir data/hf] [--docs 200000] [--json FILE]

The table is written once with ``save_to_disk`` (long-tailed lengths, 16 to about
4,000 tokens, ``input_ids`` a list of int32 as a tokenizer's ``map`` leaves it).
"""

import json
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader

import stokehold
from python_loaders import options, read_once  # this directory is on sys.path when run as a script
from python_documents import race


def write(out: Path, docs: int) -> None:
    rng = np.random.default_rng(0)
    u = rng.random(docs)
    lengths = (16.0 / (1.0 - u * 0.996)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 50_000, size=int(offsets[-1]), dtype=np.int32)
    import pyarrow as pa

    ids = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(tokens))
    table = datasets.Dataset(pa.table({"input_ids": ids}))
    table.save_to_disk(str(out), max_shard_size="16MB")


def padder(max_len: int):
    def collate(rows):
        ids = rows["input_ids"]
        out = np.zeros((len(ids), max_len), dtype=np.int32)
        lens = np.empty(len(ids), dtype=np.int64)
        for k, d in enumerate(ids):
            n = min(len(d), max_len)
            out[k, :n] = d[:n]
            lens[k] = n
        return torch.from_numpy(out), torch.from_numpy(lens)

    return collate


class Rows(torch.utils.data.Dataset):
    """A datasets table as a map-style dataset, a batch at a time (``__getitems__``)."""

    def __init__(self, table):
        self.table = table

    def __len__(self):
        return len(self.table)

    def __getitems__(self, indices):
        return self.table[indices]


def main() -> None:
    args = options(__doc__, dir="data/hf", docs=200_000, max_len=1024, seq_len=1024, batch=32,
                   workers=2, reps=3)
    out = Path(args.dir)
    if not (out / "state.json").exists():
        write(out, args.docs)
    table = datasets.load_from_disk(str(out))
    read_once(f["filename"] for f in table.cache_files)
    rows = {"documents": len(table), "shards": len(table.cache_files), "batch": args.batch,
            "workers": args.workers, "max_len": args.max_len, "seq_len": args.seq_len}

    ours = stokehold.DocumentLoader(out, max_len=args.max_len, batch_size=args.batch,
                                    shuffle="full", workers=args.workers)
    peer = DataLoader(Rows(table.with_format("numpy")), batch_size=args.batch, shuffle=True,
                      num_workers=args.workers, persistent_workers=True, prefetch_factor=4,
                      collate_fn=padder(args.max_len))
    a, b = race(ours, peer, ("tokens", "len"), args.reps)
    n = len(table)
    rows.update(padded_stokehold_samples_per_s=n / a, padded_datasets_samples_per_s=n / b,
                padded_ratio=b / a)
    print(f"{n} documents in {rows['shards']} shards, batch {args.batch}, {args.workers} workers")
    print(f"padded to {args.max_len}: stokehold {n / a:,.0f}/s, datasets + DataLoader "
          f"{n / b:,.0f}/s, {b / a:.1f}x")
    del ours, peer

    # Packing as the Hugging Face examples do it (run_clm's group_texts): a map that
    # concatenates and cuts, written as a new table, then served. Its map is paid
    # once, before training, and is not timed here.
    L = args.seq_len + 1

    def group(batch):
        flat = np.concatenate(batch["input_ids"])
        k = (len(flat) - 1) // args.seq_len
        return {"input_ids": [flat[i * args.seq_len:i * args.seq_len + L] for i in range(k)]}

    t = time.perf_counter()
    grouped = table.with_format("numpy").map(group, batched=True, batch_size=len(table),
                                             remove_columns=["input_ids"])
    rows["group_texts_map_s"] = time.perf_counter() - t
    packed = stokehold.PackedLoader(out, seq_len=args.seq_len, batch_size=args.batch,
                                    windows="consecutive", shuffle="full", workers=args.workers)
    peer = DataLoader(Rows(grouped.with_format("numpy")), batch_size=args.batch, shuffle=True,
                      num_workers=args.workers, persistent_workers=True, prefetch_factor=4,
                      collate_fn=lambda r: torch.from_numpy(np.stack(r["input_ids"])))
    ours_windows = sum(len(b) for b in packed.epoch(args.reps))
    a, b = race(packed, peer, ("tokens", "positions"), args.reps)
    w = len(grouped)
    rows.update(packed_windows=w, packed_stokehold_windows=ours_windows,
                packed_stokehold_windows_per_s=ours_windows / a,
                packed_datasets_windows_per_s=w / b)
    rows["packed_ratio"] = rows["packed_stokehold_windows_per_s"] / rows["packed_datasets_windows_per_s"]
    print(f"packed in windows of {L} (stokehold: {ours_windows} windows with "
          f"positions; datasets: {w} windows after a {rows['group_texts_map_s']:.1f} s map): "
          f"stokehold {rows['packed_stokehold_windows_per_s']:,.0f}/s, datasets + DataLoader "
          f"{w / b:,.0f}/s, {rows['packed_ratio']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
