"""Horovod's PyTorch MNIST recipe, run by manygpu.horovod: only the import line changed.

Written after Horovod's documented recipe (``examples/pytorch/pytorch_mnist.py``
and "Horovod with PyTorch" in its docs), on synthetic MNIST-shaped data so it
runs anywhere without a download:

1. ``hvd.init()``;
2. pin the GPU by local rank (``torch.cuda.set_device(hvd.local_rank())``);
3. scale the learning rate by the number of processes;
4. shard the data with ``DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank())``;
5. ``broadcast_parameters`` and ``broadcast_optimizer_state`` from rank 0;
6. wrap the optimizer in ``hvd.DistributedOptimizer``;
7. average the test metrics over processes with ``hvd.allreduce``.

Each process draws different initial weights (seeded by its rank) to show
step 5 at work: after it, every rank holds rank 0's weights, and training
gives the same weights as one process on the same global batch
(``--batch-size`` times the number of processes, at the same scaled rate).

Run::

    manygpu launch --nproc-per-node 2 examples/horovod/train_mnist_style.py
    manygpu launch -np 8 -H host1:4,host2:4 examples/horovod/train_mnist_style.py
    python examples/horovod/train_mnist_style.py        # one process
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch.utils.data import DataLoader, TensorDataset

import manygpu.horovod as hvd  # was: import horovod.torch as hvd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--test-batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01, help="per process; scaled by hvd.size()")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--no-cuda", action="store_true", default=False)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--fp16-allreduce", action="store_true", default=False)
    p.add_argument("--use-adasum", action="store_true", default=False)
    p.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    p.add_argument("--train-size", type=int, default=2048, help="synthetic training images")
    p.add_argument("--test-size", type=int, default=512, help="synthetic test images")
    p.add_argument("--save", default=None, help="rank 0 writes the final weights here")
    p.add_argument("--metrics", default=None, help="rank 0 writes the final metrics (JSON)")
    return p.parse_args()


def synthetic_digits(n: int, seed: int) -> TensorDataset:
    """MNIST-shaped images of ten fixed "digit" shapes, noisy and shifted (no download).

    Each class is one smooth pattern (a 7x7 random grid blown up to 28x28,
    the same for every split and rank), drawn under heavy noise and moved by up
    to a pixel, so the classes differ by local, roughly shift-tolerant shapes:
    what a convolutional network learns. Labels from a random linear map of
    white noise, used before, have no such structure, and this network stayed
    at chance on them.
    """
    shapes = torch.randn(10, 1, 7, 7, generator=torch.Generator().manual_seed(0))
    shapes = F.interpolate(shapes, size=28, mode="bilinear", align_corners=False)
    shapes = (shapes - shapes.mean()) / shapes.std()
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = shapes[labels] + 1.5 * torch.randn(n, 1, 28, 28, generator=gen)
    shifts = torch.randint(-1, 2, (n, 2), generator=gen)
    for dy, dx in shifts.unique(dim=0).tolist():
        moved = (shifts == torch.tensor([dy, dx])).all(1)
        images[moved] = images[moved].roll((dy, dx), dims=(2, 3))
    return TensorDataset(images, labels)


class Net(nn.Module):
    """Horovod's MNIST network without dropout (dropout masks would differ per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(val: float, name: str) -> float:
    """Average a number over every process (Horovod's example does exactly this)."""
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return float(avg_tensor.item())


def train(args, model, optimizer, train_loader, train_sampler, epoch) -> None:  # type: ignore[no-untyped-def]
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            # Horovod: use train_sampler to determine the number of examples in this shard.
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
            )


def test(args, model, test_loader, test_sampler) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.max(1, keepdim=True)[1]
            correct += float(pred.eq(target.view_as(pred)).cpu().float().sum())
    # Horovod: use test_sampler to determine the number of examples in this worker's partition.
    test_loss /= len(test_sampler)
    accuracy = correct / len(test_sampler)
    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    accuracy = metric_average(accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * accuracy:.2f}%\n")
    return test_loss, accuracy


def main() -> None:
    args = parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    kwargs = {"num_workers": 1, "pin_memory": True} if args.cuda else {}
    train_dataset = synthetic_digits(args.train_size, seed=1)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler, **kwargs
    )
    test_dataset = synthetic_digits(args.test_size, seed=2)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler, **kwargs
    )

    torch.manual_seed(args.seed + hvd.rank())  # different weights per rank, on purpose
    model = Net()
    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    loss, accuracy = float("nan"), float("nan")
    for epoch in range(1, args.epochs + 1):
        train(args, model, optimizer, train_loader, train_sampler, epoch)
        loss, accuracy = test(args, model, test_loader, test_sampler)

    if hvd.rank() == 0:
        if args.save:
            torch.save(model.state_dict(), args.save)
        if args.metrics:
            with open(args.metrics, "w") as f:
                json.dump({"size": hvd.size(), "test_loss": loss, "accuracy": accuracy}, f)


if __name__ == "__main__":
    main()
