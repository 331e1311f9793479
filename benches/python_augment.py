"""Augmentation from Python, on the same files, cores and batch size: stokehold's loader
with ``augment=`` (random crop with padding 4, horizontal flip, normalisation to
float32, in its worker threads), the same loader without it, and PyTorch's DataLoader
(2 worker processes) doing the same with torch operations: per sample, as torchvision's
``RandomCrop``/``RandomHorizontalFlip``/``ToTensor``/``Normalize`` do in ``__getitem__``,
and per batch (vectorised in ``__getitems__``, the fastest way to write it in torch).
One command, one process; the figures are ratios.

    pip install ./bindings/python torch
    python benches/python_augment.py [--data data/cifar] [--batches 300] [--json FILE]

The files are read once first so every loader reads a warm page cache.
"""

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import stokehold
from python_loaders import options, read_once  # this directory is on sys.path when run as a script

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PAD = 4


class PerSample(Dataset):
    """What a torchvision pipeline does: each sample padded, cropped, flipped,
    converted and normalised on its own."""

    def __init__(self, root: Path):
        self.x = np.load(root / "x.npy", mmap_mode="r")
        self.y = np.load(root / "y.npy", mmap_mode="r")
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        img = torch.from_numpy(np.array(self.x[i]))
        _, h, w = img.shape
        img = F.pad(img, (PAD, PAD, PAD, PAD))
        dy, dx = np.random.randint(0, 2 * PAD + 1, size=2)
        img = img[:, dy : dy + h, dx : dx + w]
        if np.random.rand() < 0.5:
            img = img.flip(-1)
        img = (img.float() / 255 - self.mean) / self.std
        return img, int(self.y[i])


def augment_batch(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """A batch of ``uint8`` images (n, c, h, w) padded, cropped, flipped and normalised
    by torch operations on the tensor's device: one pad, the crops as one indexed read."""
    n, c, h, w = x.shape
    dev = x.device
    x = F.pad(x, (PAD, PAD, PAD, PAD))
    dy = torch.randint(0, 2 * PAD + 1, (n, 1, 1), device=dev)
    dx = torch.randint(0, 2 * PAD + 1, (n, 1, 1), device=dev)
    flip = torch.rand(n, 1, 1, device=dev) < 0.5
    rows = dy + torch.arange(h, device=dev).view(1, h, 1)
    cols = torch.arange(w, device=dev).view(1, 1, w)
    cols = dx + torch.where(flip, w - 1 - cols, cols)
    x = x[torch.arange(n, device=dev).view(n, 1, 1, 1), torch.arange(c, device=dev).view(1, c, 1, 1),
          rows.unsqueeze(1), cols.unsqueeze(1)]
    return (x.float() / 255 - mean) / std


class PerBatch(PerSample):
    """The same, a batch at a time (``augment_batch`` in ``__getitems__``)."""

    def __getitems__(self, indices):
        idx = np.sort(np.asarray(indices))
        x = augment_batch(torch.from_numpy(self.x[idx]), self.mean, self.std)
        return [(x, torch.from_numpy(self.y[idx]))]


def first(items):
    return items[0]


def timed(batches, it):
    """Seconds for the first `batches` batches of `it`, and their samples."""
    t = time.perf_counter()
    samples = 0
    for k, b in enumerate(it):
        samples += len(b[1]) if isinstance(b, (tuple, list)) else len(b)
        if k + 1 == batches:
            break
    return time.perf_counter() - t, samples


def main() -> None:
    args = options(__doc__, data="data/cifar", batch=256, workers=2, batches=300)
    root = Path(args.data)
    read_once(root / f for f in ("x.npy", "y.npy"))
    torch.set_num_threads(1)
    aug = stokehold.Augment("x", crop=PAD, flip=True, mean=MEAN, std=STD)
    common = dict(batch_size=args.batch, shuffle="full", seed=0, workers=args.workers)
    plain = stokehold.Loader(root, **common)
    augmented = stokehold.Loader(root, augment=aug, **common)
    assert augmented.columns["x"] == (np.dtype(np.float32), (3, 32, 32))

    def stoke(loader, epoch):
        def run():
            it = loader.epoch(epoch)
            return timed(args.batches, ((b["x"], b["y"]) for b in it))
        run()  # threads and pool warm
        return run()

    results = {}
    results["stokehold"] = stoke(plain, 1)
    results["stokehold_augment"] = stoke(augmented, 1)
    for name, ds, kw in [
        ("torch_per_sample", PerSample(root), {}),
        ("torch_per_batch", PerBatch(root), {"collate_fn": first}),
    ]:
        dl = DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                        persistent_workers=True, prefetch_factor=4, **kw)
        timed(4, iter(dl))  # workers started
        results[name] = timed(args.batches, iter(dl))
    rate = {k: s / t for k, (t, s) in results.items()}
    for k, r in rate.items():
        print(f"{k:20s} {r:12,.0f} samples/s")
    a = rate["stokehold_augment"]
    out = {
        "samples_per_s": rate,
        "augment_vs_plain": a / rate["stokehold"],
        "augment_vs_torch_per_sample": a / rate["torch_per_sample"],
        "augment_vs_torch_per_batch": a / rate["torch_per_batch"],
    }
    emit(out, args)


def emit(out, args):
    """Adds the run's settings to `out`, prints it as one JSON line without the
    per-loader rates, and writes it whole to `--json` when given."""
    out.update(batch=args.batch, workers=args.workers, batches=args.batches)
    print(json.dumps({k: v for k, v in out.items() if k != "samples_per_s"}))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
