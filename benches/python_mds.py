"""A MosaicML Streaming (MDS) dataset from Python: stokehold's DocumentLoader reading
the shards in place, against PyTorch's DataLoader over ``streaming.StreamingDataset``
(local shards, its own shuffle, a collate function that pads to ``max_len``), as LLM
Foundry reads its token datasets. Same shards, batch size, worker count; warm page
cache; one process; the figures are ratios.

    pip install ./bindings/python torch mosaicml-streaming
    python benches/python_mds.py [--dir data/mds] [--docs 200000] [--json FILE]

The dataset is written once with ``streaming.MDSWriter`` (long-tailed lengths, 16 to
about 4,000 tokens, ``tokens`` encoded ``ndarray:int32``, 16 MB shards).
"""

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from streaming import MDSWriter, StreamingDataset
from torch.utils.data import DataLoader

import stokehold
from python_loaders import options, read_once  # this directory is on sys.path when run as a script
from python_documents import padder, race


def write(out: Path, docs: int) -> None:
    rng = np.random.default_rng(0)
    u = rng.random(docs)
    lengths = (16.0 / (1.0 - u * 0.996)).astype(np.int64)
    with MDSWriter(out=str(out), columns={"tokens": "ndarray:int32"}, size_limit="16mb") as w:
        for n in lengths:
            w.write({"tokens": rng.integers(0, 50_000, size=int(n), dtype=np.int32)})


def main() -> None:
    args = options(__doc__, dir="data/mds", docs=200_000, max_len=1024, batch=32, workers=2,
                   reps=3)
    out = Path(args.dir)
    if not (out / "index.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        write(out, args.docs)
    shards = sorted(out.glob("shard.*.mds"))
    read_once(shards)
    ours = stokehold.DocumentLoader(out, max_len=args.max_len, batch_size=args.batch,
                                    shuffle="full", workers=args.workers)
    stream = StreamingDataset(local=str(out), shuffle=True, shuffle_seed=0,
                              batch_size=args.batch)
    peer = DataLoader(stream, batch_size=args.batch, num_workers=args.workers,
                      persistent_workers=True, prefetch_factor=4,
                      collate_fn=padder(args.max_len, np.int32, lambda r: r["tokens"]))
    n = len(stream)
    assert len(ours) == -(-n // args.batch)
    a, b = race(ours, peer, ("tokens", "len"), args.reps)
    rows = {"documents": n, "shards": len(shards), "batch": args.batch,
            "workers": args.workers, "max_len": args.max_len,
            "stokehold_samples_per_s": n / a, "streaming_samples_per_s": n / b,
            "ratio": b / a}
    print(f"{n} documents in {len(shards)} MDS shards, batch {args.batch}, "
          f"{args.workers} workers, padded to {args.max_len}")
    print(f"stokehold DocumentLoader                 {n / a:>12,.0f} samples/s")
    print(f"StreamingDataset + PyTorch DataLoader    {n / b:>12,.0f} samples/s")
    print(f"ratio                                    {b / a:>12.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
