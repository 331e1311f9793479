"""A mixture of token corpora from Python: stokehold's MixLoader over three LitData
datasets of token chunks (read in place, each through a TokenLoader), against LitData's
own ``CombinedStreamingDataset`` with the same weights over ``StreamingDataset``s with
its ``TokensLoader``, through ``StreamingDataLoader``; and, for what mixing costs,
stokehold's TokenLoader over the largest corpus alone. Windows of ``seq_len + 1``
tokens, same chunks, batch size and worker count, all shuffled; warm page cache; one
process; the figures are windows per second and their ratios.

    pip install ./bindings/python torch litdata
    python benches/python_mix.py [--dir data/mix] [--json FILE]

The corpora are written once with ``litdata.optimize`` (long-tailed document lengths,
16 to about 4,000 ``uint16`` tokens, 8 MB chunks): 300,000, 150,000 and 50,000 documents,
mixed 0.5, 0.3 and 0.2 (the smallest upsampled).
"""

import json
import shutil
from pathlib import Path

import torch
from litdata import (CombinedStreamingDataset, StreamingDataLoader, StreamingDataset,
                     TokensLoader, optimize)

import stokehold
from python_loaders import options, read_once  # this directory is on sys.path when run as a script
from python_litdata import document, timed  # the same documents, the same timer

CORPORA = {"web": 300_000, "code": 150_000, "math": 50_000}
WEIGHTS = [0.5, 0.3, 0.2]


def main() -> None:
    args = options(__doc__, dir="data/mix", seq_len=1024, batch=32, workers=2, reps=3)
    dirs = []
    for k, (name, docs) in enumerate(CORPORA.items()):
        out = Path(args.dir) / name
        if not (out / "index.json").exists():
            shutil.rmtree(out, ignore_errors=True)
            start = 10_000_000 * (k + 1)
            optimize(fn=document, inputs=list(range(start, start + docs)), output_dir=str(out),
                     chunk_bytes="8MB", item_loader=TokensLoader(), num_workers=1)
        read_once(out.glob("chunk-*.bin"))
        dirs.append(out)
    sources = [stokehold.TokenLoader(d, seq_len=args.seq_len, windows="consecutive")
               for d in dirs]
    ours = stokehold.MixLoader(sources, WEIGHTS, batch_size=args.batch, shuffle="full",
                               workers=args.workers)
    alone = stokehold.TokenLoader(dirs[0], seq_len=args.seq_len, batch_size=args.batch,
                                  windows="consecutive", shuffle="full", workers=args.workers)
    streams = [StreamingDataset(str(d), item_loader=TokensLoader(block_size=args.seq_len + 1),
                                shuffle=True, seed=0) for d in dirs]
    combined = CombinedStreamingDataset(streams, seed=0, weights=WEIGHTS, iterate_over_all=False)
    peer = StreamingDataLoader(combined, batch_size=args.batch, num_workers=args.workers,
                               persistent_workers=True)
    counts = {"mix": 0, "alone": 0, "peer": 0}

    def drain(loader, key):
        def run(epoch: int) -> None:
            counts[key] = sum(len(torch.from_dlpack(b["tokens"])) for b in loader.epoch(epoch))
        return run

    def run_peer(epoch: int) -> None:
        combined.set_epoch(epoch)
        counts["peer"] = sum(len(b) for b in peer)

    runs = {"mix": drain(ours, "mix"), "alone": drain(alone, "alone"), "peer": run_peer}
    times = {k: [] for k in runs}
    for r in range(args.reps):  # alternating, so the machine's noise hits all three
        for k, run in runs.items():
            times[k].append(timed(run, r))
    rate = {k: counts[k] / min(times[k]) for k in runs}
    rows = {"corpora": {n: len(list(d.glob("chunk-*.bin"))) for n, d in zip(CORPORA, dirs)},
            "weights": WEIGHTS, "takes": ours.takes, "seq_len": args.seq_len,
            "batch": args.batch, "workers": args.workers,
            "stokehold_mix_windows": counts["mix"], "stokehold_alone_windows": counts["alone"],
            "litdata_windows": counts["peer"],
            "stokehold_mix_windows_per_s": rate["mix"],
            "stokehold_alone_windows_per_s": rate["alone"],
            "litdata_windows_per_s": rate["peer"]}
    rows["ratio"] = rate["mix"] / rate["peer"]
    rows["mix_over_alone"] = rate["mix"] / rate["alone"]
    print(f"3 LitData corpora mixed {WEIGHTS}, windows of {args.seq_len + 1}, batch {args.batch}, "
          f"{args.workers} workers")
    print(f"stokehold MixLoader                           {rate['mix']:>12,.0f} windows/s")
    print(f"stokehold TokenLoader, largest corpus alone   {rate['alone']:>12,.0f} windows/s")
    print(f"litdata CombinedStreamingDataset + loader     {rate['peer']:>12,.0f} windows/s")
    print(f"ratio to litdata                              {rows['ratio']:>12.1f}x")
    print(f"mix / alone                                   {rows['mix_over_alone']:>12.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
