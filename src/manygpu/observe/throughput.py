"""Samples per second between two ``par.log`` calls, counted from the prepared training loaders.

The figure rides along with every log call (``throughput/samples_per_s``), so a
user who logs only the loss still sees the job's speed. It needs no code of
theirs and no collective: every training loader :meth:`~manygpu.Parallel.prepare`
made tells the meter when it hands out a batch and how long the batch took to
arrive (the same hook that feeds the straggler board's step clock), and the
meter counts each batch's real size: the rows of its first tensor, so an
epoch's short last batch counts what it holds, not the loader's ``batch_size``.

The interval starts when the first batch after the previous log was asked for,
not at the previous log: an evaluation, a checkpoint or another tool's timing
run between a log and the next training batch is not training time. It ends
when ``par.log`` is called. Within it everything the training loop does counts:
waiting for data, forward, backward, the optimizer, gradient sync.

The main rank's count stands for every data shard: a prepared loader gives
every rank of a shard the same number of batches of the same size, so the
global figure is the main rank's samples times the number of data shards
(ranks of a tensor-parallel group read the same samples and count once).
Not measured in the straggler board's step clock, which runs only with two or
more processes and ``stragglers`` on; this meter works in one process too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

KEY = "throughput/samples_per_s"
"""The name the figure is logged under: samples per second over all data shards."""


class SampleMeter:
    """Counts this rank's training samples and the time they took, between log calls."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._samples = 0
        self._since: float | None = None

    def batch(self, samples: int, waited_s: float) -> None:
        """A training batch of ``samples`` arrived after ``waited_s`` seconds of waiting."""
        if self._since is None:  # the interval starts when this batch was asked for
            self._since = self._clock() - max(waited_s, 0.0)
        self._samples += samples

    def exclude(self, seconds: float) -> None:
        """``seconds`` of the interval were not training (a profile window writing its
        trace): left out of the figure, as if the interval began that much later."""
        if self._since is not None:
            self._since += seconds

    def started(self, waited_s: float) -> None:
        """A loader's wait callback: a batch came after ``waited_s`` (:meth:`count` counts it)."""
        self.batch(0, waited_s)

    def count(self, batch: Any) -> None:
        """A loader's batch callback: add the batch's samples."""
        self._samples += batch_samples(batch)

    @property
    def samples(self) -> int:
        """This rank's samples counted since the interval began."""
        return self._samples

    def take(self, shards: int) -> dict[str, float]:
        """``{KEY: samples/s}`` over ``shards`` data shards since the interval began, then
        start a new interval; empty when no training batch arrived since the last call."""
        samples, since = self._samples, self._since
        self._samples, self._since = 0, None
        if since is None or samples == 0:
            return {}
        elapsed = self._clock() - since
        if elapsed <= 0:
            return {}
        return {KEY: samples * max(shards, 1) / elapsed}


def batch_samples(batch: Any) -> int:
    """The samples in ``batch``: the first dimension of its first tensor (tensors, tuples,
    lists, dicts of them); 0 when it holds no tensor with a dimension."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 0
