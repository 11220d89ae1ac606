"""Keras' ``MirroredStrategy`` "just use every GPU" recipe, done with ``Parallel()``.

The classic recipe (TensorFlow's "Distributed training with Keras")::

    strategy = tf.distribute.MirroredStrategy()            # every visible GPU
    print("Number of devices:", strategy.num_replicas_in_sync)
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    with strategy.scope():
        model = build_model()
        model.compile(loss=..., optimizer=..., metrics=["accuracy"])
    model.fit(train_dataset.batch(BATCH_SIZE), epochs=EPOCHS)
    model.evaluate(eval_dataset)

Here ``Parallel()`` with no strategy plays ``MirroredStrategy()``: started
alone it trains on one device; started by ``manygpu launch`` it runs one
process per local GPU (two CPU processes on a machine without GPUs) and picks
``ddp``. The script has no device logic at all. As in Keras, the batch handed
to the loader is the *global* batch, split over the replicas
(``split_batches=True``), so the optimisation is the same whatever the
number of devices.

Run::

    manygpu launch examples/mirrored_all_devices.py     # every local GPU, or 2 CPU processes
    python examples/mirrored_all_devices.py             # one device
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from manygpu import Parallel
from manygpu.demo.data import digits

BATCH_SIZE_PER_REPLICA = 32


def build_model() -> nn.Module:
    """The Keras tutorial's CNN: Conv2D(32) -> MaxPool -> Dense(64) -> Dense(10)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def fit(
    par: Parallel, model: nn.Module, train_set: Dataset, *, epochs: int, batch_size: int
) -> nn.Module:
    """``model.fit``: train with Adam on the global batch, report the mean loss per epoch."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True)
    model, opt, loader = par.prepare(model, opt, loader)
    for epoch in range(1, epochs + 1):
        total = torch.zeros(1, device=par.device)
        for x, y in par.progress(loader, f"Epoch {epoch}/{epochs}"):
            loss = F.cross_entropy(model(x), y)
            par.backward(loss)
            opt.step()
            opt.zero_grad()
            total += loss.detach()
        mean = par.reduce(total / len(loader), "mean")
        par.print(f"Epoch {epoch}/{epochs} - loss: {mean.item():.4f}")
    return model


def evaluate(par: Parallel, model: nn.Module, test_set: Dataset) -> float:
    """``model.evaluate``: accuracy over every test sample once, whatever the replicas."""
    loader = par.prepare_loader(DataLoader(test_set, batch_size=256), train=False)
    model.eval()
    counts = torch.zeros(2, device=par.device)
    with torch.no_grad():
        for x, y in loader:
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += y.numel()
    total = par.reduce(counts, "sum")
    return float(total[0] / total[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()

    with Parallel(split_batches=True) as par:  # the MirroredStrategy() line
        par.print(f"Number of devices: {par.world_size} ({par.strategy_name} on {par.device.type})")
        batch_size = BATCH_SIZE_PER_REPLICA * par.world_size
        train_set, test_set = digits(image_size=16)
        model = fit(par, build_model(), train_set, epochs=args.epochs, batch_size=batch_size)
        par.print(f"Eval accuracy: {evaluate(par, model, test_set):.1%}")


if __name__ == "__main__":
    main()
