"""Trains a small PyTorch model on datasets/digits through stokehold, and prints the
epoch report (the table and warm-up split of `stokehold train`).

    pip install ./bindings/python torch
    python examples/python/train_torch.py [--epochs 10] [--data datasets/digits]
    python examples/python/train_torch.py --device cuda [--device-cache]   # on a GPU

With ``--device cuda`` stokehold copies each batch to the GPU on its own stream and
torch reads it there through DLPack; ``--device-cache`` keeps the dataset on the GPU
after epoch 0, so later epochs gather their batches there.
"""

import argparse
from pathlib import Path

import torch

import stokehold


def main() -> None:
    here = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(here / "datasets" / "digits"))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", default="cpu", help='"cpu", "cuda" or "cuda:N"')
    p.add_argument("--device-cache", action="store_true",
                   help="with a CUDA device: keep the dataset there after epoch 0")
    args = p.parse_args()

    torch.manual_seed(0)
    dev = torch.device(args.device)
    loader = stokehold.Loader(
        args.data, batch_size=args.batch, shuffle="full", seed=0, workers=2,
        device=None if dev.type == "cpu" else args.device, device_cache=args.device_cache)
    (x_dtype, x_shape), _ = loader.columns["x"], loader.columns["y"]
    features = int(torch.tensor(x_shape).prod())
    model = torch.nn.Sequential(
        torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")

    def step(x: torch.Tensor, y: torch.Tensor):
        # Digits pixels are 0..16: scale to 0..1.
        logits = model(x.reshape(len(x), -1).float() / 16.0)
        loss = loss_fn(logits, y)
        opt.zero_grad()
        (loss / len(x)).backward()
        opt.step()
        return loss.item(), int((logits.argmax(1) == y).sum())

    report = stokehold.TrainReport(loader, device=f"torch ({args.device})")
    for epoch in range(args.epochs):
        timer = stokehold.EpochTimer(loader.epoch(epoch))
        for batch in timer:
            # Zero-copy: the tensors view the loader's buffers (on a GPU, its device
            # slots, which torch's stream waits for).
            x = torch.from_dlpack(batch["x"])
            y = torch.from_dlpack(batch["y"]).long()  # a no-op for int64 labels
            loss_sum, correct = timer.step(step, x, y)
            timer.record(loss_sum, correct, len(batch))
        report.push(timer.finish())
    report.print()
    if args.device_cache:
        print(f"device cache: {loader.device_cache_bytes} bytes, filled: {loader.device_cache_filled}")
    acc = report.json()["epochs"][-1]["accuracy"]
    print(f"accuracy at the last epoch: {100 * acc:.1f}%")


if __name__ == "__main__":
    main()
