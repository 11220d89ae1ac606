"""Streams of numbered samples, read and trained on by a prepared loader.

``torch``: a plain ``IterableDataset`` (no shards: manygpu's every-k-th
fallback), shuffled per epoch by its ``set_epoch``. ``hf``: a Hugging Face
iterable dataset of 6 shards (split by ``split_dataset_by_node``), shuffled
with a seed. Every sample carries its id, so tests can check who saw what.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from reference import make_data, make_model
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from manygpu import Parallel
from manygpu.checkpoint import Checkpointer

SAMPLES = 1003


class Numbers(IterableDataset):
    """``n`` samples (id, x, y), in an order that depends on the epoch when shuffled."""

    def __init__(self, n: int = SAMPLES, shuffle: bool = True) -> None:
        self.n, self.shuffle, self.epoch = n, shuffle, 0
        self.x, self.y = make_data(n)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        order = range(self.n)
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        for i in order:
            yield int(i), self.x[i], self.y[i]


def hf_numbers(n: int = SAMPLES, shards: int = 6) -> Any:
    import datasets

    x, y = make_data(n)
    table = datasets.Dataset.from_dict({"id": list(range(n)), "x": x.tolist(), "y": y.tolist()})
    stream = table.to_iterable_dataset(num_shards=shards).shuffle(seed=3, buffer_size=32)
    return stream.with_format("torch")


def loader(kind: str, batch: int, workers: int, n: int = SAMPLES) -> DataLoader:
    """A user's loader (global ``batch``) over the ``kind`` stream."""
    data = Numbers(n) if kind == "torch" else hf_numbers(n)
    return DataLoader(data, batch_size=batch, num_workers=workers)


def unpack(kind: str, batch: Any) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    if kind == "torch":
        ids, x, y = batch
        return ids.tolist(), x, y
    return batch["id"].tolist(), batch["x"].float(), batch["y"].float()


def read_epochs(par: Parallel, kind: str, batch: int, workers: int, epochs: int) -> list[Any]:
    """Per epoch, the ids of each step's batch on this rank."""
    prepared = par.prepare(loader(kind, batch, workers))
    return [[unpack(kind, b)[0] for b in prepared] for _ in range(epochs)]


def steps(
    par: Parallel,
    kind: str,
    directory: str | Path,
    total: int,
    *,
    every: int = 0,
    batch: int = 8,
    workers: int = 2,
) -> Iterator[tuple[int, list[int]]]:
    """Train to step ``total`` (resuming from ``directory``), yielding each step and this
    rank's ids once the step is checkpointed: a caller may interleave two streams."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, prepared = par.prepare(model, opt, loader(kind, batch, workers))
    ckpt = Checkpointer(par, directory, model=model, optimizer=opt, loader=prepared, every=every)
    state = ckpt.resume()
    while state.step < total:
        for b in prepared:
            ids, x, y = unpack(kind, b)
            par.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            state.step += 1
            ckpt.after_step(state)
            yield state.step, ids
            if state.step >= total:
                break
    ckpt.close()


def train(
    par: Parallel,
    kind: str,
    directory: str | Path,
    total: int,
    *,
    every: int = 0,
    kill_at: int = -1,
    batch: int = 8,
    workers: int = 2,
    attempt: int = 0,
) -> dict[int, list[int]]:
    """Train to step ``total`` (resuming from ``directory``); step -> this rank's ids.

    Rank 1 SIGKILLs itself after step ``kill_at`` when the launcher's restart
    count is ``attempt``.
    """
    seen: dict[int, list[int]] = {}
    for step, ids in steps(par, kind, directory, total, every=every, batch=batch, workers=workers):
        seen[step] = ids
        if step == kill_at and killing(attempt, par):
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dies mid-epoch
    return seen


def killing(attempt: int, par: Parallel) -> bool:
    """Whether this is rank 1 on the launcher's attempt ``attempt`` (the one to kill)."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return restarts == attempt and par.rank == 1
