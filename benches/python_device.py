"""Batches on a CUDA device from Python, on the same files, cores and batch size, each
read by a PyTorch step on the GPU (one reduction kernel per batch, so that the batch's
bytes are used on the device and nothing else limits the rate):

- ``stokehold_device``: ``Loader(device="cuda")``, the batch gathered into pinned memory
  by the workers, copied on stokehold's own stream, and handed to torch through DLPack;
- ``stokehold_device_cache``: ``Loader(device="cuda", device_cache=True)`` after the
  epoch that fills the cache: each batch gathered on the GPU from the device copy of the
  dataset (no host gathering, no copy but the indices);
- ``stokehold_host``: the host loader, each batch then copied by torch
  (``torch.from_dlpack(b["x"]).to("cuda", non_blocking=True)``);
- ``torch_pinned``: PyTorch's DataLoader (2 worker processes, ``pin_memory=True``), then
  ``.to("cuda", non_blocking=True)``: what a PyTorch training loop does;

and, with a random crop (padding 4), a flip and a normalisation to ``float32``:

- ``stokehold_device_augment``: ``device="cuda", augment=``: the raw bytes copied, the
  GPU augments them;
- ``stokehold_device_cache_augment``: the same, from the device cache (the raw images
  gathered there, then augmented);
- ``stokehold_host_augment``: ``augment=`` on the host loader (the workers augment),
  then four times the bytes copied by torch;
- ``torch_gpu_augment``: PyTorch's DataLoader with pinned memory, the ``uint8`` batch
  copied, then augmented by torch operations on the GPU.

One command, one process; the figures are ratios. On a machine without a GPU it says so
and measures nothing (and fails where ``STOKEHOLD_REQUIRE_GPU=1``); ``--torch-device cpu``
runs the same loops with host batches and torch on the CPU, to check the script.

    pip install ./bindings/python torch
    python benches/python_device.py [--data data/cifar] [--batches 300] [--json FILE]

The files are read once first so every loader reads a warm page cache.
"""

import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import stokehold
# This directory is on sys.path when run as a script.
from python_augment import MEAN, PAD, STD, augment_batch, emit, first
from python_loaders import Npy, options, read_once


def main() -> None:
    args = options(__doc__, data="data/cifar", batch=256, workers=2, batches=300, torch_device="cuda")
    dev = torch.device(args.torch_device)
    on_gpu = dev.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("python_device: torch sees no GPU: nothing measured")
        sys.exit(1 if os.environ.get("STOKEHOLD_REQUIRE_GPU") == "1" else 0)
    root = Path(args.data)
    read_once(root / f for f in ("x.npy", "y.npy"))
    torch.set_num_threads(1)
    device = str(dev) if on_gpu else None
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1)
    aug = stokehold.Augment("x", crop=PAD, flip=True, mean=MEAN, std=STD)
    common = dict(batch_size=args.batch, shuffle="full", seed=0, workers=args.workers)

    def sync():
        if on_gpu:
            torch.cuda.synchronize(dev)

    def timed(batches, xs):
        """Seconds for the first `batches` tensors of `xs` to be reduced on `dev`, and
        their samples; the last reduction is waited for."""
        sync()
        t = time.perf_counter()
        samples, acc = 0, torch.zeros((), device=dev)
        for k, x in enumerate(xs):
            assert x.device.type == dev.type, x.device
            acc += x.float().mean()
            samples += len(x)
            del x
            if k + 1 == batches:
                break
        sync()
        assert torch.isfinite(acc)
        return time.perf_counter() - t, samples

    def stoke(loader, to, epoch=1):
        """Two passes over `batches` batches of `loader` (threads, pool, slots warm),
        each batch's "x" through `to`; the second timed."""
        def run():
            return timed(args.batches, (to(torch.from_dlpack(b["x"])) for b in loader.epoch(epoch)))
        run()
        return run()

    def copy(x):
        return x.to(dev, non_blocking=True)

    def cached(**kw):
        """A loader with a device cache, filled by a whole epoch 0."""
        loader = stokehold.Loader(root, device=device, device_cache=True, **kw, **common)
        assert loader.device_cache_bytes, "the dataset does not fit the device cache"
        for _ in loader.epoch(0):
            pass
        assert loader.device_cache_filled
        return loader

    results = {}
    results["stokehold_device"] = stoke(stokehold.Loader(root, device=device, **common), lambda x: x)
    if on_gpu:
        results["stokehold_device_cache"] = stoke(cached(), lambda x: x)
        results["stokehold_device_cache_augment"] = stoke(cached(augment=aug), lambda x: x)
    results["stokehold_host"] = stoke(stokehold.Loader(root, **common), copy)
    results["stokehold_device_augment"] = stoke(
        stokehold.Loader(root, device=device, augment=aug, **common), lambda x: x)
    results["stokehold_host_augment"] = stoke(stokehold.Loader(root, augment=aug, **common), copy)
    dl = DataLoader(Npy(root), batch_size=args.batch, shuffle=True, num_workers=args.workers,
                    collate_fn=first, pin_memory=on_gpu, persistent_workers=True, prefetch_factor=4)
    timed(4, (copy(x) for x, _ in dl))  # workers started
    results["torch_pinned"] = timed(args.batches, (copy(x) for x, _ in dl))
    results["torch_gpu_augment"] = timed(
        args.batches, (augment_batch(copy(x), mean, std) for x, _ in dl))

    rate = {k: s / t for k, (t, s) in results.items()}
    for k, r in rate.items():
        print(f"{k:26s} {r:12,.0f} samples/s")
    out = {
        "device": torch.cuda.get_device_name(dev) if on_gpu else "cpu",
        "samples_per_s": rate,
        "device_vs_host": rate["stokehold_device"] / rate["stokehold_host"],
        "device_vs_torch_pinned": rate["stokehold_device"] / rate["torch_pinned"],
        "device_augment_vs_host_augment":
            rate["stokehold_device_augment"] / rate["stokehold_host_augment"],
        "device_augment_vs_torch_gpu_augment":
            rate["stokehold_device_augment"] / rate["torch_gpu_augment"],
        "device_augment_vs_device": rate["stokehold_device_augment"] / rate["stokehold_device"],
    }
    if on_gpu:
        out["device_cache_vs_device"] = rate["stokehold_device_cache"] / rate["stokehold_device"]
        out["device_cache_augment_vs_device_augment"] = (
            rate["stokehold_device_cache_augment"] / rate["stokehold_device_augment"])
    emit(out, args)


if __name__ == "__main__":
    main()
