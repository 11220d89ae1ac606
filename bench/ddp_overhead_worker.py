"""One rank of one run of ``bench/ddp_overhead.py``: train, time, report.

Started once per rank by a launcher (``torch.distributed.run`` or ``manygpu
launch``); every variant trains the same model on the same data with the same
per-rank batch, optimizer and thread count, on the CPU with gloo. Only the
set-up and the training step differ, and those are the only variant-specific
code here: each ``setup_*`` function returns a :class:`Trainer` and
:func:`measure` times every variant with the same harness.

Rank 0 writes a :class:`WorkerResult` as JSON to ``--out``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/ddp_overhead_worker.py --variant manygpu --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from manygpu.demo.data import digits
from manygpu.demo.model import SimpleCNN

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What every variant trains; identical across variants within a benchmark."""

    variant: str
    """Which set-up to time: a key of :data:`SETUPS`."""
    steps: int
    """Timed optimizer steps per rank."""
    warmup: int
    """Untimed steps first (allocator, autograd and gloo warm-up)."""
    batch_size: int
    """Samples per rank per step."""
    image_size: int
    """Side of the upsampled digits fed to SimpleCNN."""
    seed: int
    """Model initialisation and shuffling seed."""


@dataclass
class Trainer:
    """A variant reduced to what the timing harness needs."""

    batches: Iterator[Batch]
    """Endless (x, y) batches on the device, epoch after epoch."""
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """One forward/backward/optimizer step; returns the detached loss."""
    close: Callable[[], None]
    """Tear down what the set-up created (the process group)."""


@dataclass
class WorkerResult:
    """What rank 0 reports for one run."""

    variant: str
    world_size: int
    per_rank_batch: int
    steps: int
    warmup: int
    threads_per_rank: int
    seconds: float
    samples_per_s: float
    final_loss: float


def train_data(image_size: int) -> Dataset:
    return digits(image_size=image_size)[0]


def fresh_model(cfg: WorkerConfig) -> nn.Module:
    """The same initial weights on every rank and in every variant."""
    torch.manual_seed(cfg.seed)
    return SimpleCNN(image_size=cfg.image_size)


def fresh_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def own_generator(cfg: WorkerConfig) -> torch.Generator:
    """A generator for a hand-built ``DataLoader``, so its iterators leave torch's RNG alone.

    Without one, every ``iter(loader)`` (every epoch) draws a seed from torch's
    global RNG, the stream dropout also draws from: that one draw shifts every
    later dropout mask, and the variants, identical in data and arithmetic, end
    at different losses. manygpu's prepared loader carries a generator of its
    own for the same reason (a resumed run keeps the model's random stream).
    """
    return torch.Generator().manual_seed(cfg.seed)


def endless(loader: object) -> Iterator[Batch]:
    """Iterate ``loader`` forever; each ``iter()`` is one epoch."""
    while True:
        yield from loader  # type: ignore[misc]


# -- the variants -------------------------------------------------------------
def setup_torch_ddp(cfg: WorkerConfig) -> Trainer:
    """Hand-written DDP, as in PyTorch's tutorial: no helper library at all."""
    dist.init_process_group("gloo")  # env:// from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = train_data(cfg.image_size)
    model = nn.parallel.DistributedDataParallel(fresh_model(cfg))
    opt = fresh_optimizer(model)
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,
        generator=own_generator(cfg),
    )

    def batches() -> Iterator[Batch]:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return Trainer(batches=batches(), step=step, close=dist.destroy_process_group)


def setup_manygpu(cfg: WorkerConfig) -> Trainer:
    """manygpu's ``ddp`` strategy with its defaults, forced onto the CPU.

    Those defaults are part of what is measured: e.g. ``gradient_as_bucket_view``
    is on in manygpu's ``DDP`` and off in a bare ``DistributedDataParallel``.
    """
    from manygpu import Parallel

    par = Parallel(strategy="ddp", device="cpu", seed=cfg.seed)
    dataset = train_data(cfg.image_size)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    model = fresh_model(cfg)
    model, opt, loader = par.prepare(model, fresh_optimizer(model), loader)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        par.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return Trainer(batches=endless(loader), step=step, close=par.close)


def setup_accelerate(cfg: WorkerConfig) -> Trainer:
    """Hugging Face Accelerate, as its quick tour writes it (``cpu=True``: gloo)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    dataset = train_data(cfg.image_size)
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=True,
        generator=own_generator(cfg),
    )
    model = fresh_model(cfg)
    model, opt, loader = acc.prepare(model, fresh_optimizer(model), loader)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return Trainer(batches=endless(loader), step=step, close=_destroy_group)


def setup_fabric(cfg: WorkerConfig) -> Trainer:
    """Lightning Fabric's ``ddp`` strategy on the CPU, under the launcher's ranks."""
    from lightning_fabric import Fabric

    # A Fabric script states its devices; under a launcher they must match its
    # LOCAL_WORLD_SIZE (Fabric checks), so take the launcher's number.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // local
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=local, num_nodes=nodes)
    fabric.launch()  # under torchelastic: joins the group, starts no processes
    dataset = train_data(cfg.image_size)
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=True,
        generator=own_generator(cfg),
    )
    model = fresh_model(cfg)
    model, opt = fabric.setup(model, fresh_optimizer(model))
    loader = fabric.setup_dataloaders(loader)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return Trainer(batches=endless(loader), step=step, close=_destroy_group)


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


SETUPS: dict[str, Callable[[WorkerConfig], Trainer]] = {
    "torch_ddp": setup_torch_ddp,
    "manygpu": setup_manygpu,
    "accelerate": setup_accelerate,
    "fabric": setup_fabric,
}
"""Variant name -> set-up; the parent script lists the same names."""


# -- the harness, identical for every variant -----------------------------------
def measure(trainer: Trainer, cfg: WorkerConfig) -> WorkerResult:
    """Warm up, then time ``cfg.steps`` steps between two barriers.

    Fetching batches is inside the timed loop: the loader is part of what each
    library prepares. The closing barrier makes the time the slowest rank's.
    """
    loss = torch.zeros(())
    for _ in range(cfg.warmup):
        loss = trainer.step(*next(trainer.batches))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg.steps):
        loss = trainer.step(*next(trainer.batches))
    dist.barrier()
    seconds = time.perf_counter() - start
    world = dist.get_world_size()
    return WorkerResult(
        variant=cfg.variant,
        world_size=world,
        per_rank_batch=cfg.batch_size,
        steps=cfg.steps,
        warmup=cfg.warmup,
        threads_per_rank=torch.get_num_threads(),
        seconds=seconds,
        samples_per_s=cfg.steps * cfg.batch_size * world / seconds,
        final_loss=float(loss),
    )


def parse_args(argv: list[str] | None = None) -> tuple[WorkerConfig, str]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, choices=sorted(SETUPS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON file rank 0 writes its result to")
    ns = p.parse_args(argv)
    cfg = WorkerConfig(
        variant=ns.variant,
        steps=ns.steps,
        warmup=ns.warmup,
        batch_size=ns.batch_size,
        image_size=ns.image_size,
        seed=ns.seed,
    )
    return cfg, ns.out


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_args(argv)
    trainer = SETUPS[cfg.variant](cfg)
    try:
        result = measure(trainer, cfg)
        if dist.get_rank() == 0:
            with open(out, "w") as fh:
                json.dump(asdict(result), fh, indent=2)
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
