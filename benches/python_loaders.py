"""From Python, on the same files, cores and batch size: stokehold's loader taken by a
Python loop, the same loader drained in Rust (no Python per batch), and PyTorch's
DataLoader (a map-style dataset with batched ``__getitems__`` over memory-mapped
``.npy`` files, 2 workers). One command, one process; the figures are ratios.

    pip install ./bindings/python torch
    python benches/python_loaders.py [--data data/cifar] [--batch 256] [--workers 2] [--json FILE]

The files are read once first so every loader reads a warm page cache.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import stokehold


class Npy(Dataset):
    """x.npy and y.npy, memory-mapped, batched through ``__getitems__``."""

    def __init__(self, root: Path):
        self.x = np.load(root / "x.npy", mmap_mode="r")
        self.y = np.load(root / "y.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.x[i])), int(self.y[i])

    def __getitems__(self, indices):
        idx = np.sort(np.asarray(indices))
        return [(torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx]))]


def collate(items):
    return items[0]


def options(doc, **defaults):
    """The command line of a Python benchmark: an option for each of ``defaults``
    (``max_len=1024`` is ``--max-len``, of its default's type), then ``--json FILE``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--json")
    return p.parse_args()


def read_once(paths):
    """Reads each file through, so the loaders compared read a warm page cache."""
    for path in paths:
        with open(path, "rb") as fh:
            while fh.read(64 << 20):
                pass


def best_of(reps, fn):
    return min(fn() for _ in range(reps))


def main() -> None:
    args = options(__doc__, data="data/cifar", batch=256, workers=2, reps=3)
    root = Path(args.data)
    read_once(root / f for f in ("x.npy", "y.npy"))

    loader = stokehold.Loader(root, batch_size=args.batch, shuffle="full", seed=0, workers=args.workers)
    n = sum(len(b) for b in loader.epoch(0))  # threads and pool warm

    def rust():
        samples, secs = loader._raw.drain(1)
        assert samples == n
        return secs

    def python():
        t = time.perf_counter()
        samples = 0
        for batch in loader.epoch(2):
            x, y = batch["x"], batch["y"]
            samples += len(y)
        assert samples == n
        return time.perf_counter() - t

    def python_torch():
        t = time.perf_counter()
        samples = 0
        for batch in loader.epoch(3):
            x, y = torch.from_dlpack(batch["x"]), torch.from_dlpack(batch["y"])
            samples += len(y)
        assert samples == n
        return time.perf_counter() - t

    ds = Npy(root)
    torch_loader = DataLoader(
        ds,
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        collate_fn=collate,
        persistent_workers=True,
        prefetch_factor=4,
    )
    for _ in torch_loader:  # workers started
        break

    def pytorch():
        t = time.perf_counter()
        samples = 0
        for x, y in torch_loader:
            samples += len(y)
        assert samples == n
        return time.perf_counter() - t

    secs = {
        "rust": best_of(args.reps, rust),
        "python": best_of(args.reps, python),
        "python_torch": best_of(args.reps, python_torch),
        "pytorch_dataloader": best_of(args.reps, pytorch),
    }
    rate = {k: n / v for k, v in secs.items()}
    out = {
        "data": str(root),
        "samples": n,
        "batch": args.batch,
        "workers": args.workers,
        "samples_per_s": rate,
        "python_over_rust": rate["python"] / rate["rust"],
        "python_torch_over_rust": rate["python_torch"] / rate["rust"],
        "python_over_pytorch": rate["python"] / rate["pytorch_dataloader"],
    }
    for k, v in rate.items():
        print(f"{k:>20}: {v:>12,.0f} samples/s  ({secs[k]:.3f} s per epoch)")
    print(f"python / rust:              {out['python_over_rust']:.2f}")
    print(f"python + from_dlpack / rust: {out['python_torch_over_rust']:.2f}")
    print(f"python / pytorch DataLoader: {out['python_over_pytorch']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
