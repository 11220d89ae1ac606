"""PyTorch's ``nn.DataParallel`` tutorial loop, done with ``Parallel(strategy="dp")``.

The classic recipe ("Optional: Data Parallelism" in the PyTorch tutorials)::

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model = Model(input_size, output_size)
    if torch.cuda.device_count() > 1:
        print("Let's use", torch.cuda.device_count(), "GPUs!")
        model = nn.DataParallel(model)
    model.to(device)
    for data in rand_loader:
        input = data.to(device)
        output = model(input)
        print("Outside: input size", input.size(), "output_size", output.size())

Here the device choice, the ``device_count() > 1`` test and the ``.to(device)``
calls are gone: ``Parallel(strategy="dp")`` wraps the model in
``nn.DataParallel`` over every visible GPU (or runs it plainly on the CPU) and
the prepared loader hands out batches already on the right device. As in the
tutorial, the model records the batch size each replica saw, so on a machine
with N GPUs you see the batch split N ways; on the CPU one replica sees it all.
Unlike the tutorial, the loop also trains (on scikit-learn's digits) and reports
held-out accuracy.

``dp`` is one process driving all GPUs; manygpu warns once that ``ddp`` is
faster. The loop itself does not change between the two: launched as several
processes, pass ``--strategy ddp`` (``dp`` refuses to run in more than one).

Run::

    python examples/dataparallel_loop.py
    manygpu launch --nproc-per-node 2 examples/dataparallel_loop.py --strategy ddp
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from manygpu import Parallel
from manygpu.demo.data import digits


class Model(nn.Module):
    """The tutorial's model, made big enough to learn 8x8 digits.

    ``seen_batch_sizes`` shows how ``nn.DataParallel`` splits a batch: its
    replicas are shallow copies of this module, so they all append to this
    one list (``list.append`` is atomic under the GIL, so the replica threads
    can share it).
    """

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(input_size, 128), nn.ReLU(), nn.Linear(128, output_size)
        )
        self.seen_batch_sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_batch_sizes.append(x.size(0))
        return self.net(x)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="dp", help="dp (one process) or ddp (under launch)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=30, help="the tutorial's batch size")
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    with Parallel(strategy=args.strategy) as par:
        train_set, test_set = digits(image_size=8)
        net = Model(input_size=8 * 8, output_size=10)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
        loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
        model, opt, loader = par.prepare(net, opt, loader)  # net stays the module inside
        test_loader = par.prepare_loader(DataLoader(test_set, batch_size=256), train=False)
        par.print(f"{par!r}; {len(train_set)} training digits")

        for epoch in range(1, args.epochs + 1):
            for step, (x, y) in enumerate(loader):
                net.seen_batch_sizes.clear()
                output = model(x)
                if epoch == 1 and step == 0:
                    par.print(f"  In Model: batch sizes per replica {net.seen_batch_sizes}")
                    par.print(
                        f"  Outside: input size {tuple(x.shape)}, output size {tuple(output.shape)}"
                    )
                loss = F.cross_entropy(output, y)
                par.backward(loss)
                opt.step()
                opt.zero_grad()
            par.print(f"epoch {epoch}  last-batch loss {loss.item():.3f}")

        model.eval()
        correct = torch.zeros(2, device=par.device)
        with torch.no_grad():
            for x, y in test_loader:
                correct[0] += (model(x).argmax(1) == y).sum()
                correct[1] += y.numel()
        total = par.reduce(correct, "sum")  # a no-op in one process; sums over ranks under ddp
        par.print(f"held-out accuracy {float(total[0] / total[1]):.1%}")


if __name__ == "__main__":
    main()
