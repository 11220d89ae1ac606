"""Iterable (streaming) datasets split over ranks and data-loader workers.

A map-style dataset is split by indices (a sampler); a stream has no indices,
so each reader must pick its own share while reading. Two ways, chosen by the
dataset:

* Hugging Face ``datasets.IterableDataset``: ``split_dataset_by_node`` gives
  each rank whole shards (when their number divides by the ranks; otherwise
  every rank-th example), and the dataset gives each loader worker whole
  shards of its rank's part. Ranks then hold different numbers of batches, so
  before every step the ranks agree, in one tiny all-reduce (bounded by the
  job's timeout), that every one of them still has a batch: all stop with the
  shortest (a rank's surplus, and each worker's last incomplete batch, are
  dropped). Which shards a worker gets depends on the number of workers, so a
  resume needs the same ``num_workers`` too.
* any other ``torch.utils.data.IterableDataset`` (the fallback: it has no
  shards): every worker of every rank reads the whole stream and keeps its
  blocks. Sample ``i`` is in global batch ``i // (world * batch)``, rank ``r``
  holding its ``r``-th block of ``batch`` samples, worker ``w`` every
  ``w``-th global batch: the steps are one process's consecutive global
  batches cut in ``world`` pieces. A training loader keeps only complete
  global batches (the stream's last ``len % (world * batch)`` samples are
  dropped), which every reader sees alike: equal steps with no communication.
  The stream is shown no loader worker (``get_worker_info()`` is ``None``
  while it runs), so one that reads only its worker's slice (torch's idiom)
  still yields the whole stream to each reader. A resume on another world or
  batch size starts at the last whole new global batch before the saved
  position (:func:`manygpu.checkpoint.resumed.position`; the rest is read
  again, as the resume line says).

Either way the order must be the same on every rank, epoch after epoch: a
dataset that is itself an iterator (read once) or whose first sample differs
between ranks (an unseeded shuffle) is refused. A dataset with ``set_epoch``
is told the epoch before each one (its shuffle changes per epoch).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils import worker as torch_worker

from manygpu.comm.common import wait as wait_work
from manygpu.comm.objects import all_gather_json
from manygpu.core.data import PreparedLoader, per_rank_batch, worker_start
from manygpu.errors import UsageError


def is_huggingface(dataset: object) -> bool:
    """A Hugging Face ``datasets.IterableDataset`` (known without importing ``datasets``)."""
    cls = type(dataset)
    return cls.__module__.startswith("datasets.") and hasattr(dataset, "n_shards")


class BlockSplit(IterableDataset[Any]):
    """One rank's blocks of a stream, spread over its loader workers (the fallback).

    Every worker reads the whole stream and keeps its own samples: that costs
    reading it ``world * workers`` times, the price of a stream without shards.
    The stream runs as if in the main process (:func:`read_whole`).
    """

    def __init__(self, stream: Iterable[Any], rank: int, world: int, batch: int) -> None:
        self.stream, self.rank, self.world, self.batch = stream, rank, world, batch
        self.skip = 0
        """Samples of the epoch already trained on (a resume): read past, never kept."""
        self.complete_only = True
        """Keep only whole global batches (training: equal steps on every rank)."""

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        reader = Reader(self.rank, self.world, worker, workers)
        stream = self.stream if info is None else read_whole(self.stream)
        return blocks(stream, reader, self.batch, self.skip, self.complete_only)


def read_whole(stream: Iterable[Any]) -> Iterator[Any]:
    """``stream``'s samples read in a loader worker as if in the main process.

    A stream that splits itself over workers (``__iter__`` reads its slice by
    ``get_worker_info()``, torch's own idiom) would hand each worker a part,
    and :func:`blocks`, which expects the whole, would keep a ``1/workers``
    share of that part: samples lost without an error. So the worker is
    hidden for every call into the stream (its ``iter()`` and each ``next()``,
    as a generator asks only when first resumed): torch keeps it in one
    module variable, which its own worker loop never reads in between.
    """
    shown = torch_worker._worker_info
    torch_worker._worker_info = None
    try:
        samples = iter(stream)
    finally:
        torch_worker._worker_info = shown
    while True:
        torch_worker._worker_info = None
        try:
            sample = next(samples)
        except StopIteration:
            return
        finally:
            torch_worker._worker_info = shown
        yield sample


class Reader(NamedTuple):
    """One reader of a stream: a loader worker of a rank."""

    rank: int
    world: int
    worker: int
    workers: int


def blocks(
    stream: Iterable[Any], reader: Reader, batch: int, skip: int, complete_only: bool
) -> Iterator[Any]:
    """``reader``'s samples of ``stream``, after its first ``skip`` (see the module docstring).

    Only whole global batches with ``complete_only``; a worker's samples come
    out in blocks of ``batch``, so the loader's batches are exactly the blocks.
    """
    per_step = reader.world * batch
    mine: list[Any] = []  # this reader's block of the global batch being read
    for index, sample in enumerate(stream):
        if index < skip:
            continue
        step, within = divmod(index - skip, per_step)
        if step % reader.workers == reader.worker and within // batch == reader.rank:
            mine.append(sample)
        if within == per_step - 1:  # the global batch is whole: hand over our block
            yield from mine
            mine = []
    if not complete_only:
        yield from mine


_PLAIN = (int, float, str, bytes, bool, type(None))


def _fingerprint(sample: Any) -> str:
    """A digest of a sample's content, equal across processes.

    Only content goes in: tensors and numpy arrays by their bytes, plain values
    by value, other objects by ``tobytes()`` when they have it (a PIL image).
    Anything else counts by its type name alone, as its ``repr`` may hold a
    memory address, different in every process.
    """
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        digest.update(type(value).__name__.encode())
        if isinstance(value, torch.Tensor):
            digest.update(str((value.dtype, tuple(value.shape))).encode())
            digest.update(value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, np.ndarray):
            digest.update(str((value.dtype, value.shape)).encode() + value.tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                feed(value[key])
        elif isinstance(value, list | tuple):
            for item in value:
                feed(item)
        elif isinstance(value, _PLAIN):
            digest.update(repr(value).encode())
        elif callable(getattr(value, "tobytes", None)):
            digest.update(value.tobytes())

    feed(sample)
    return digest.hexdigest()


def check_reproducible(dataset: Any, *, timeout_s: float) -> None:
    """Refuse a stream whose order cannot be the same on every rank.

    Reads its first sample once on each rank (collective when distributed).
    """
    name = type(dataset).__name__
    if isinstance(dataset, Iterator):
        raise UsageError(
            f"the IterableDataset {name} is an iterator (it can be read once): make its "
            "__iter__ return a new iterator each call, so every rank and worker can read it"
        )
    first = _fingerprint(next(iter(dataset), None))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    prints = all_gather_json(first, operation="stream order check", timeout_s=timeout_s)
    if len(set(prints)) > 1:
        raise UsageError(
            f"the IterableDataset {name} starts with a different sample on different ranks, "
            "so it cannot be split: seed its shuffle (e.g. ds.shuffle(seed=...)), the same "
            "seed on every rank, and change the order per epoch in a set_epoch(epoch) method"
        )


def _refuse_loader(loader: DataLoader) -> None:
    if loader.batch_size is None:
        raise UsageError(
            "a DataLoader over an IterableDataset needs batch_size= (manygpu splits the "
            "stream in blocks of one batch); batch_size=None is not supported"
        )
    if loader.persistent_workers:
        raise UsageError(
            "persistent_workers=True keeps each worker's copy of the stream from the first "
            "epoch, so the epoch and a resume position would not reach it: drop it"
        )


def _split(dataset: Any, rank: int, world: int, batch: int, train: bool) -> Any:
    if is_huggingface(dataset):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world)
    split = BlockSplit(dataset, rank, world, batch)
    split.complete_only = train
    return split


def prepare_stream(
    loader: DataLoader,
    *,
    rank: int,
    world: int,
    train: bool,
    split_batches: bool,
    device: torch.device,
    timeout_s: float,
    **prepared: Any,
) -> PreparedStream:
    """This rank's share of a loader over an ``IterableDataset``.

    ``prepared``: :class:`PreparedLoader`'s keywords (hooks, seed, layout).
    """
    _refuse_loader(loader)
    check_reproducible(loader.dataset, timeout_s=timeout_s)
    batch = per_rank_batch(int(loader.batch_size or 0), world, split_batches)
    split = _split(loader.dataset, rank, world, batch, train)
    agreed = train and world > 1 and not isinstance(split, BlockSplit)
    rebuilt = DataLoader(
        split,
        batch_size=batch,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=device.type == "cuda" or loader.pin_memory,
        # Shards end in incomplete batches; a training step wants whole ones.
        drop_last=loader.drop_last or (train and not isinstance(split, BlockSplit)),
        timeout=loader.timeout,
        worker_init_fn=worker_start(loader.worker_init_fn),
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator or torch.Generator(),
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
    )
    # A gloo group of its own: the flag is a CPU tensor whatever the training backend.
    timeout = dt.timedelta(seconds=timeout_s)
    group = dist.new_group(backend="gloo", timeout=timeout) if agreed else None
    return PreparedStream(
        rebuilt,
        device,
        group=group,
        timeout_s=timeout_s,
        split_batches=split_batches,
        **prepared,
    )


_AGREEMENT = "stream step agreement (does every rank still have a batch?)"


class PreparedStream(PreparedLoader):
    """A :class:`PreparedLoader` over a stream: no length, steps agreed, resumable.

    The position saved is the same as a map-style loader's (epoch, batches
    each rank took), so the Checkpointer needs nothing else. A resume skips
    samples inside the readers (the fallback; any world size), or replays the
    batches already taken (Hugging Face shards; the same world and batch size).
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        *,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 180.0,
        split_batches: bool = False,
        **prepared: Any,
    ) -> None:
        super().__init__(loader, device, **prepared)
        self._group, self._timeout_s = group, timeout_s
        self._split_batches = split_batches  # the user's batch_size is the global one
        self._skip = 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Start the next ``iter()`` at ``epoch``, after its first ``skip_batches`` (resuming)."""
        self.epoch, self._skip = epoch, skip_batches
        self._position = (epoch, skip_batches)

    def __len__(self) -> int:
        raise TypeError("a prepared IterableDataset loader has no length (it is a stream)")

    def state_dict(self) -> dict[str, int]:
        """The position; a sharded stream's also holds its loader workers (they deal
        the shards, so another number reads other samples)."""
        where = super().state_dict()
        if isinstance(self.loader.dataset, BlockSplit):
            return where
        return where | {"workers": self.loader.num_workers}

    def check_resume(self, saved: dict[str, int], *, world: int) -> None:
        """Shards split by node replay the batches this rank took, which only
        another world size, batch size or number of loader workers would read
        differently: refuse that (nothing to replay at an epoch's start)."""
        if isinstance(self.loader.dataset, BlockSplit) or not int(saved.get("batches", 0)):
            return  # the fallback skips samples: any world and batch size
        ranks, batch = int(saved.get("world", world)), int(saved.get("batch_size", 0))
        if (ranks, batch) != (world, int(self.loader.batch_size or 0)):
            # In the user's units: with split_batches their batch_size is the global one.
            size = ranks * batch if self._split_batches else batch
            unit = "global batch" if self._split_batches else "batch"
            raise UsageError(
                f"this checkpoint's stream position was saved at {ranks} ranks x {unit} "
                f"{size}, and a sharded (Hugging Face) stream resumes exactly only on the "
                f"same; relaunch with {ranks} processes and batch_size={size}, or start "
                "the epoch over"
            )
        workers = int(saved.get("workers", self.loader.num_workers))
        if workers != self.loader.num_workers:
            raise UsageError(
                f"this checkpoint's stream position was saved with num_workers={workers}, and "
                "a sharded (Hugging Face) stream deals its shards by the number of loader "
                f"workers; give the DataLoader num_workers={workers}, or start the epoch over"
            )

    def _start(self, epoch: int, skip: int) -> Iterator[Any]:
        """The rebuilt loader's iterator for ``epoch``, positioned after ``skip`` batches."""
        split = self.loader.dataset
        stream = split.stream if isinstance(split, BlockSplit) else split
        if hasattr(stream, "set_epoch"):
            stream.set_epoch(epoch)  # before iter(): workers get their copy then
        if isinstance(split, BlockSplit):
            split.skip = skip * split.world * split.batch
        if self._generator_seed is not None and self.loader.generator is not None:
            self.loader.generator.manual_seed(self._generator_seed + epoch)
        batches = iter(self.loader)
        if not isinstance(split, BlockSplit):
            for _ in range(skip):  # agreed when they were first read: no all-reduce now
                next(batches, None)
        return batches

    def _next(self, batches: Iterator[Any]) -> Any:
        """The next batch, or None when this rank or any other has run out."""
        batch = next(batches, None)
        if self._group is None:
            return batch
        have = torch.tensor([0 if batch is None else 1], dtype=torch.int32)
        work = dist.all_reduce(have, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
        wait_work(work, _AGREEMENT, self._timeout_s)  # a named error, not a raw gloo one
        return batch if int(have.item()) else None

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self.epoch, self._skip
        self.epoch, self._skip = epoch + 1, 0
        batches = self._start(epoch, skip)
        channels_last = self._channels_last is not None and self._channels_last()
        wait, start = self._on_wait, time.perf_counter()
        ahead, taken = self._next(batches), skip
        while ahead is not None:
            # One batch ahead: the last one is known before it is handed out.
            batch, ahead, taken = ahead, self._next(batches), taken + 1
            last = ahead is None
            if last and self._on_last_batch is not None:
                self._on_last_batch()  # end a partial accumulation cycle with the epoch
            self._position = (epoch + 1, 0) if last else (epoch, taken)
            yield self._deliver(batch, channels_last, wait, start)
            start = time.perf_counter()
