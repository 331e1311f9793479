"""A LitData dataset of token chunks from Python: stokehold's TokenLoader reading the
chunks in place, against LitData's own ``StreamingDataset`` with its ``TokensLoader``
and ``StreamingDataLoader``, as litgpt's pretraining reads them. Windows of
``seq_len + 1`` tokens (stokehold's overlap by one token, LitData's blocks do not: the
figures are windows per second), same chunks, batch size, worker count, both shuffled;
warm page cache; one process; the figures are ratios.

    pip install ./bindings/python torch litdata
    python benches/python_litdata.py [--dir data/litdata] [--docs 200000] [--json FILE]

The dataset is written once with ``litdata.optimize`` (long-tailed document lengths,
16 to about 4,000 ``uint16`` tokens, 8 MB chunks).
"""

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader, optimize

import stokehold
from python_loaders import options, read_once  # this directory is on sys.path when run as a script


def document(k: int):
    rng = np.random.default_rng(k)
    n = int(16.0 / (1.0 - rng.random() * 0.996))
    yield torch.from_numpy(rng.integers(0, 50_000, size=n).astype(np.uint16))


def timed(run, epoch: int) -> float:
    t = time.perf_counter()
    run(epoch)
    return time.perf_counter() - t


def main() -> None:
    args = options(__doc__, dir="data/litdata", docs=200_000, seq_len=1024, batch=32, workers=2,
                   reps=3)
    out = Path(args.dir)
    if not (out / "index.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        optimize(fn=document, inputs=list(range(args.docs)), output_dir=str(out),
                 chunk_bytes="8MB", item_loader=TokensLoader(), num_workers=1)
    chunks = sorted(out.glob("chunk-*.bin"))
    read_once(chunks)
    ours = stokehold.TokenLoader(out, seq_len=args.seq_len, batch_size=args.batch,
                                 windows="consecutive", shuffle="full", workers=args.workers)
    stream = StreamingDataset(str(out), item_loader=TokensLoader(block_size=args.seq_len + 1),
                              shuffle=True, seed=0)
    peer = StreamingDataLoader(stream, batch_size=args.batch, num_workers=args.workers,
                               persistent_workers=True)
    counts = {"ours": 0, "peer": 0}

    def run_ours(epoch: int) -> None:
        counts["ours"] = sum(len(torch.from_dlpack(b["tokens"])) for b in ours.epoch(epoch))

    def run_peer(epoch: int) -> None:
        stream.set_epoch(epoch)
        counts["peer"] = sum(len(b) for b in peer)

    a, b = [], []
    for r in range(args.reps):  # alternating, so the machine's noise hits both
        a.append(timed(run_ours, r))
        b.append(timed(run_peer, r))
    a, b = min(a), min(b)
    rows = {"chunks": len(chunks), "seq_len": args.seq_len, "batch": args.batch,
            "workers": args.workers, "stokehold_windows": counts["ours"],
            "litdata_windows": counts["peer"],
            "stokehold_windows_per_s": counts["ours"] / a,
            "litdata_windows_per_s": counts["peer"] / b}
    rows["ratio"] = rows["stokehold_windows_per_s"] / rows["litdata_windows_per_s"]
    print(f"{len(chunks)} LitData chunks, windows of {args.seq_len + 1}, batch {args.batch}, "
          f"{args.workers} workers")
    print(f"stokehold TokenLoader                        {rows['stokehold_windows_per_s']:>12,.0f} windows/s")
    print(f"litdata StreamingDataset + StreamingDataLoader {rows['litdata_windows_per_s']:>10,.0f} windows/s")
    print(f"ratio                                        {rows['ratio']:>12.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
