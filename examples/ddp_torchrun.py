"""The classic DistributedDataParallel + torchrun recipe, done with ``Parallel(strategy="ddp")``.

The recipe from PyTorch's DDP tutorials, in outline::

    dist.init_process_group("nccl")                 # torchrun set RANK, WORLD_SIZE...
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    model = DDP(model.to(local_rank), device_ids=[local_rank])
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                    # else every epoch has the same order
        for x, y in loader:
            x, y = x.to(local_rank), y.to(local_rank)
            ...
        if dist.get_rank() == 0:
            print(...); torch.save(model.module.state_dict(), path)
    dist.destroy_process_group()

Against a plain single-device loop, these are the lines that change here
(``+`` new, ``~`` changed); everything else is the single-device code::

    + par = Parallel(strategy="ddp")                        # process group, device, seeds
    + model, opt, loader = par.prepare(model, opt, loader)  # DDP wrap, DistributedSampler
    ~ par.backward(loss)                                    # was loss.backward()
    ~ par.print(...)                                        # was print(...): rank 0 only
    + par.close()                                           # destroy_process_group

Gone are the environment variables, ``set_device``, the sampler and its
``set_epoch`` (the prepared loader advances the epoch on every ``iter()``),
the ``.to(device)`` on each batch, and the ``rank == 0`` tests (``par.print``,
``par.is_main``). The held-out accuracy is computed on each rank's share of the
test set and summed with ``par.reduce``, so every test digit counts once.

Run (2 CPU processes with gloo here; one process per GPU on a GPU machine)::

    manygpu launch --nproc-per-node 2 examples/ddp_torchrun.py
    torchrun --nproc-per-node 2 examples/ddp_torchrun.py    # works too
    python examples/ddp_torchrun.py                         # one process, same code
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from manygpu import Parallel
from manygpu.demo.data import digits
from manygpu.demo.model import SimpleCNN


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process, as with DDP")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--save", default=None, help="write the trained weights here (rank 0)")
    return p.parse_args()


def evaluate(par: Parallel, model: torch.nn.Module, loader: object) -> float:
    """Accuracy over the whole test set: each rank counts its share, then we sum."""
    model.eval()
    counts = torch.zeros(2, device=par.device)
    with torch.no_grad():
        for x, y in loader:  # type: ignore[attr-defined]
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += y.numel()
    model.train()
    total = par.reduce(counts, "sum")
    return float(total[0] / total[1])


def main() -> None:
    args = parse_args()
    par = Parallel(strategy="ddp")
    try:
        train_set, test_set = digits(image_size=16)
        model = SimpleCNN(image_size=16)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
        model, opt, loader = par.prepare(model, opt, loader)
        # Evaluation: each test sample exactly once over all ranks, no padding.
        test_loader = par.prepare_loader(DataLoader(test_set, batch_size=256), train=False)
        par.print(f"{par!r}: {len(loader)} steps of {args.batch_size} per rank per epoch")

        for epoch in range(1, args.epochs + 1):
            for x, y in par.progress(loader, f"epoch {epoch}"):
                loss = F.cross_entropy(model(x), y)
                par.backward(loss)
                opt.step()
                opt.zero_grad()
            mean_loss = par.reduce(loss.detach(), "mean")
            acc = evaluate(par, model, test_loader)
            par.print(f"epoch {epoch}  loss {mean_loss.item():.3f}  held-out accuracy {acc:.1%}")

        if args.save and par.is_main:
            # unwrap: save the user's module, not DDP's wrapper ("module." prefixes).
            torch.save(par.unwrap(model).state_dict(), args.save)
            par.print(f"saved weights to {args.save}")
    finally:
        par.close()


if __name__ == "__main__":
    main()
