"""stokehold's loader against PyTorch's DataLoader, on the same files, in one run.

    python3 benches/peer_pytorch.py [DATA_DIR] [--epochs N] [--json FILE]

DATA_DIR holds x.npy and y.npy (default data/cifar, made by `stokehold train` or
`stokehold gen`). Needs torch and numpy, and a release build of stokehold
(`cargo build --release`). Nothing here runs in CI.

Both sides: batch 256, a full shuffle, 2 workers, a warm page cache (stokehold bench's
warm-up pass reads the files first), and a consumer that only takes each batch. stokehold's
figure is the loader's median from `stokehold bench` (run first, in this same command).
PyTorch is measured two ways, each with persistent workers and one epoch of warm-up:

- per-sample: a map-style Dataset whose __getitem__ returns one sample, collated by the
  default collate function: the way most PyTorch code is written;
- batched: a BatchSampler passed as the sampler, so __getitem__ gets the batch's
  indices and gathers them with one numpy fancy index on the memory map: the fastest
  plain-PyTorch way we know.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

BATCH = 256
WORKERS = 2


class PerSample(Dataset):
    def __init__(self, root):
        self.root = root
        self.n = np.load(os.path.join(root, "y.npy"), mmap_mode="r").shape[0]
        self.x = self.y = None

    def _open(self):
        # Opened in each worker, after the fork.
        if self.x is None:
            self.x = np.load(os.path.join(self.root, "x.npy"), mmap_mode="r")
            self.y = np.load(os.path.join(self.root, "y.npy"), mmap_mode="r")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self._open()
        return torch.from_numpy(np.array(self.x[i])), int(self.y[i])


class Batched(PerSample):
    def __getitem__(self, idx):
        self._open()
        idx = np.asarray(idx)
        return torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx])


def epochs_per_second(loader, epochs):
    """Samples per second over `epochs` epochs, after one epoch of warm-up."""
    for _ in loader:
        pass
    t = time.perf_counter()
    samples = 0
    for _ in range(epochs):
        for batch in loader:
            samples += len(batch[1])
    return samples / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data", nargs="?", default="data/cifar")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--stokehold", default="target/release/stokehold")
    args = ap.parse_args()

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(
            [args.stokehold, "bench", "--data", args.data, "--json", f.name],
            check=True,
            stdout=sys.stderr,
        )
        bench = json.load(open(f.name))
    stokehold = bench["loader"]["samples_per_s"]
    roofline = bench["roofline"]["samples_per_s"]

    torch.set_num_threads(1)
    common = dict(num_workers=WORKERS, persistent_workers=True, prefetch_factor=4)
    per_sample = DataLoader(
        PerSample(args.data), batch_size=BATCH, shuffle=True, **common
    )
    ds = Batched(args.data)
    batched = DataLoader(
        ds,
        batch_size=None,
        sampler=BatchSampler(RandomSampler(ds), BATCH, drop_last=False),
        **common,
    )
    result = {
        "data": args.data,
        "batch": BATCH,
        "workers": WORKERS,
        "torch": torch.__version__,
        "stokehold_samples_per_s": stokehold,
        "roofline_samples_per_s": roofline,
        "pytorch_per_sample_samples_per_s": epochs_per_second(per_sample, args.epochs),
        "pytorch_batched_samples_per_s": epochs_per_second(batched, args.epochs),
    }
    result["stokehold_vs_per_sample"] = stokehold / result["pytorch_per_sample_samples_per_s"]
    result["stokehold_vs_batched"] = stokehold / result["pytorch_batched_samples_per_s"]
    for k, v in result.items():
        print(f"{k:36} {v:,.3f}" if isinstance(v, float) else f"{k:36} {v}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
