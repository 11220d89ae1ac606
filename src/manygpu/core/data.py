"""Data loaders that split work over ranks and put batches on the device."""

from __future__ import annotations

import functools
import gc
import itertools
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from manygpu.errors import UsageError
from manygpu.runtime.device import move_to_device


class ShardSampler(Sampler[int]):
    """Every ``world``-th index from ``rank``: each sample exactly once, no padding.

    For evaluation, where a duplicated sample would skew a metric and ranks
    need not run the same number of batches (they only meet in a final reduce).
    """

    def __init__(self, length: int, rank: int, world: int) -> None:
        self.length, self.rank, self.world = length, rank, world

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world))


class ResumableSampler(Sampler[int]):
    """A ``DistributedSampler`` that can start an epoch part-way through.

    After a restart the loader must continue with the batch after the last one
    trained on, with the same shuffle: skipping indices here costs nothing,
    whereas skipping batches would load and collate them for nothing.
    """

    def __init__(self, base: DistributedSampler, batch_size: int) -> None:
        self.base = base
        self.batch_size = batch_size
        self.skip_batches = 0

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.base), self.skip_batches * self.batch_size, None)

    def __len__(self) -> int:
        return max(len(self.base) - self.skip_batches * self.batch_size, 0)


def batch_to_channels_last(batch: Any) -> Any:
    """Every 4-D floating tensor inside (nested) tuples, lists and dicts as channels_last.

    Image batches (N, C, H, W) only: labels, token ids and masks keep their layout.
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 4 and batch.is_floating_point():
            return batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, dict):
        return {k: batch_to_channels_last(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(batch_to_channels_last(v) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(batch_to_channels_last(v) for v in batch)
    return batch


def _seed_worker(worker_id: int) -> None:
    """DataLoader seeds torch per worker; seed numpy and random from it too."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


WorkerInit = Callable[[int], None]


def worker_start(user_init: WorkerInit | None) -> WorkerInit:
    """The ``worker_init_fn`` of a prepared loader: :func:`_start_worker`, then the
    user's own (or numpy's and random's seeds). A ``partial``, not a closure: a
    spawned worker receives it pickled."""
    return functools.partial(_start_worker, user_init or _seed_worker)


def _start_worker(user_init: WorkerInit, worker_id: int) -> None:
    """Freeze what a loader worker inherited out of Python's collector, then run ``user_init``.

    A forked worker starts with a copy of the parent's heap, garbage included:
    objects in reference cycles not yet collected when the loader forked, such as
    a process group or store a finished job left behind. Collected in the worker,
    a C++ destructor may join threads that exist only in the parent, and the
    worker aborts ("terminate called after throwing an instance of
    'std::system_error'", seen in this project's suite). Those objects are the
    parent's to free; :func:`gc.freeze` (O(1): it moves the collector's lists)
    keeps the worker's collections to what the worker itself makes, as CPython's
    documentation advises for forked children, which also spares the copy of
    every page a collection would touch.
    """
    gc.freeze()
    user_init(worker_id)


def per_rank_batch(batch_size: int, world: int, split: bool) -> int:
    """The batch each rank loads; validates a global batch against the world."""
    if not split:
        return batch_size
    if batch_size < world:
        raise UsageError(
            f"global batch size {batch_size} is smaller than the world size {world}: "
            f"every rank needs at least one sample; use a batch of at least {world}"
        )
    if batch_size % world:
        raise UsageError(
            f"global batch size {batch_size} does not divide over {world} ranks; "
            f"use a multiple of {world}"
        )
    return batch_size // world


def _train_sampler(loader: DataLoader, rank: int, world: int, seed: int) -> DistributedSampler:
    sampler = loader.sampler
    if not isinstance(sampler, RandomSampler | SequentialSampler | DistributedSampler):
        raise UsageError(
            f"cannot shard a DataLoader with a custom {type(sampler).__name__}; pass "
            "shuffle=True/False instead, or shard the data yourself and prepare() only the model"
        )
    shuffle = isinstance(sampler, RandomSampler) or (
        isinstance(sampler, DistributedSampler) and sampler.shuffle
    )
    return DistributedSampler(
        loader.dataset,
        num_replicas=world,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=loader.drop_last,
    )


def rebuild_loader(
    loader: DataLoader,
    *,
    rank: int,
    world: int,
    train: bool,
    seed: int,
    split_batches: bool,
    pin_memory: bool,
) -> DataLoader:
    """A copy of ``loader`` that reads this rank's share of the data."""
    if isinstance(loader.dataset, IterableDataset):
        raise UsageError(
            "an IterableDataset cannot be split by manygpu; yield each rank's share inside "
            "the dataset (use manygpu's rank / world_size) and prepare() only the model"
        )
    if loader.batch_size is None:
        raise UsageError(
            "DataLoader has a custom batch_sampler; give it batch_size= and shuffle= so "
            "manygpu can split the data, or shard it yourself"
        )
    batch = per_rank_batch(loader.batch_size, world, split_batches)
    if train:
        sampler: Sampler[int] = ResumableSampler(_train_sampler(loader, rank, world, seed), batch)
    else:
        sampler = ShardSampler(len(loader.dataset), rank, world)  # type: ignore[arg-type]
    return DataLoader(
        loader.dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=pin_memory or loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=worker_start(loader.worker_init_fn),
        multiprocessing_context=loader.multiprocessing_context,
        # Our own generator: creating an iterator draws a seed from it, and from
        # the global RNG otherwise, which would shift the model's random stream
        # between a run and its resumption.
        generator=loader.generator or torch.Generator(),
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        persistent_workers=loader.persistent_workers,
    )


Wait = Callable[[float], None]
"""Told how long a batch took to arrive, in seconds."""


def _both(first: Wait, second: Wait) -> Wait:
    def call(seconds: float) -> None:
        first(seconds)
        second(seconds)

    return call


class PreparedLoader:
    """Iterates a rank's share on its device and advances the epoch by itself.

    Each ``iter()`` is one epoch: the sampler is told the epoch first, so every
    epoch has its own shuffle and every rank agrees on it.
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        on_last_batch: Callable[[], None] | None = None,
        generator_seed: int | None = None,
        channels_last: Callable[[], bool] | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self.loader = loader
        self._on_wait = on_wait  # told how long each batch took to arrive (the step clock)
        # Asked per epoch, not fixed here: the model that decides may be
        # prepared after its loader.
        self._channels_last = channels_last
        self._generator_seed = generator_seed
        self.device = device
        self.epoch = 0
        self._on_last_batch = on_last_batch
        self._position = (0, 0)  # (epoch being read, batches handed out in it)

    def also_on_wait(self, hook: Wait) -> None:
        """Tell ``hook`` too how long each batch took to arrive (the throughput meter)."""
        first = self._on_wait
        self._on_wait = hook if first is None else _both(first, hook)

    _on_batch: Callable[[Any], None] | None = None

    def also_on_batch(self, hook: Callable[[Any], None]) -> None:
        """Hand ``hook`` each batch as it is handed out (the throughput meter counts its
        samples: an epoch's last batch may be short)."""
        self._on_batch = hook

    def _handed(self, batch: Any) -> None:
        if self._on_batch is not None:
            self._on_batch(batch)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Start the next ``iter()`` at ``epoch``, after its first ``skip_batches`` (resuming)."""
        self.epoch = epoch
        self._position = (epoch, skip_batches)
        sampler = self.loader.sampler
        if isinstance(sampler, ResumableSampler):
            sampler.skip_batches = skip_batches
        elif skip_batches:
            raise ValueError("this loader cannot skip batches (evaluation loaders start at 0)")

    def state_dict(self) -> dict[str, int]:
        """Where reading stands: resuming from this continues with the next batch."""
        return {"epoch": self._position[0], "batches": self._position[1]}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(int(state["epoch"]), int(state["batches"]))

    def check_resume(self, saved: dict[str, int], *, world: int) -> None:
        """Refuse a saved position this loader cannot continue exactly (none here:
        a map-style loader maps samples onto any world and batch size)."""

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def _deliver(
        self,
        batch: Any,
        channels_last: bool,
        wait: Callable[[float], None] | None,
        start: float,
    ) -> Any:
        """``batch`` on the device, its wait since ``start`` reported, counted."""
        batch = move_to_device(batch, self.device)
        # On the device, after the copy: the layout change is one cheap kernel
        # there, and the host-to-device copy stays one contiguous block.
        batch = batch_to_channels_last(batch) if channels_last else batch
        if wait is not None:
            wait(time.perf_counter() - start)
        self._handed(batch)
        return batch

    def __iter__(self) -> Iterator[Any]:
        sampler = self.loader.sampler
        if isinstance(sampler, DistributedSampler | ResumableSampler):
            sampler.set_epoch(self.epoch)
        skipped = sampler.skip_batches if isinstance(sampler, ResumableSampler) else 0
        epoch, self.epoch = self.epoch, self.epoch + 1
        if self._generator_seed is not None and self.loader.generator is not None:
            # Worker seeds then depend on the epoch alone, not on how many epochs
            # this process has run: a resumed epoch gets the same ones.
            self.loader.generator.manual_seed(self._generator_seed + epoch)
        total = len(self.loader)
        channels_last = self._channels_last is not None and self._channels_last()
        wait, start = self._on_wait, time.perf_counter()
        try:
            for index, batch in enumerate(self.loader):
                if index == total - 1 and self._on_last_batch is not None:
                    # End a partial accumulation cycle with the epoch, so no
                    # gradient is carried into the next epoch unsynchronised.
                    self._on_last_batch()
                last = index == total - 1  # then a resume starts the next epoch
                self._position = (epoch + 1, 0) if last else (epoch, skipped + index + 1)
                yield self._deliver(batch, channels_last, wait, start)
                start = time.perf_counter()
        finally:
            if isinstance(sampler, ResumableSampler):
                sampler.skip_batches = 0  # only the resumed epoch starts late
