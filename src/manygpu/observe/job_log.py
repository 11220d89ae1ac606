"""``par.log``: metrics reduced over the ranks, written to the job's one tracked run.

One part of :class:`~manygpu.Parallel`, given what it needs when it is built:
the trackers (:mod:`manygpu.tracking`) open on the main rank at the first
call, the configuration they record once is described here (the job's facts
from ``Parallel``, plus world, hosts and versions), and the straggler board's
latest per-rank step split and the job's samples per second since the last
call (:mod:`manygpu.observe.throughput`) ride along with the next call, so those
figures reach the trackers without code of the user's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from manygpu.comm.objects import all_gather_json
from manygpu.errors import UsageError
from manygpu.observe.throughput import SampleMeter
from manygpu.runtime import env as envmod
from manygpu.runtime import ray_train
from manygpu.tracking.reducer import reduce_values
from manygpu.tracking.registry import check_names
from manygpu.tracking.run import TrackingRun

if TYPE_CHECKING:
    from manygpu.observe.straggler_board import StepReports
    from manygpu.runtime.cluster import ClusterInfo


class _Metered(Protocol):
    """A prepared loader, as the throughput meter sees it."""

    def also_on_wait(self, hook: Callable[[float], None]) -> None: ...

    def also_on_batch(self, hook: Callable[[Any], None]) -> None: ...


L = TypeVar("L", bound=_Metered)

DEFAULT_RUN_DIR = "runs"
_SPLIT = ("step_ms", "input_ms", "compute_ms", "comm_ms", "link_ms")
"""The straggler board's per-rank figures logged as ``manygpu/rank{r}/{name}``."""


class JobLog:
    """``log``, and the run's state that checkpoints carry."""

    def __init__(
        self, *, log_with: tuple[str, ...], run_dir: str | None, cluster: ClusterInfo,
        is_main: bool, device: torch.device, timeout_s: float,
        gather: Callable[[torch.Tensor], torch.Tensor], facts: Callable[[], dict[str, Any]],
        shard_count: Callable[[], int], job_step: Callable[[], int | None],
        reports: StepReports | None,
    ) -> None:  # fmt: skip
        """``facts``: the job's resolved configuration (strategy, precision, ...), asked
        for when a run opens; ``job_step``: the job's step once a ``Checkpointer``
        has seen one; ``reports``: this rank's straggler reports (``None``: off)."""
        self.log_with, self._run_dir = log_with, run_dir
        self._cluster, self._is_main, self._device = cluster, is_main, device
        self._timeout_s, self._gather, self._facts = timeout_s, gather, facts
        self._shard_count, self._job_step, self._reports = shard_count, job_step, reports
        self._run: TrackingRun | None = None
        self._logged_window: int | None = None
        self._hosts_set = False
        self._meter: SampleMeter | None = None
        if self.log_with:  # a missing extra (every rank) or a refused store (main): now
            self._tracking().preflight()

    def log(
        self,
        values: Mapping[str, Any],
        *,
        step: int | None = None,
        reduce: Mapping[str, str] | None = None,
    ) -> dict[str, float]:
        """Reduce ``values`` over every rank and log them at ``step`` (collective).

        Every rank calls it with the same keys. Values are numbers or 1-element
        tensors, reduced by their mean, or as ``reduce={"tokens": "sum",
        "max_mem": "max"}`` says per key, all in one collective; the main rank
        writes them to the trackers of ``log_with``. ``step=None``: the step
        after the last one logged; once a ``Checkpointer`` has seen a step, the
        job's training step (its ``TrainState.step`` or the optimizer steps,
        whichever is ahead), so logging before or after ``ckpt.after_step``
        numbers alike, across resumes too. Returns the reduced values (on every rank).
        """
        run = self._tracking()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise UsageError(f"par.log(step={step!r}): give an integer >= 0, or leave it out")
        at = run.next_step(step, self._job_step())
        if not self._hosts_set:
            self._share_host()
        reduced = reduce_values(values, reduce, self._gather, self._exchange, self._device)
        run.write(reduced | self._step_figures() | self._throughput(), at)
        ray_train.note_metrics(reduced)  # under Ray Train: sent with the next checkpoint
        return reduced

    def tracking_state(self) -> dict[str, Any] | None:
        """What a checkpoint stores of the run (id, last step); ``None`` without ``log_with``."""
        return None if not self.log_with else self._tracking().state()

    def resume(self, saved: Mapping[str, Any] | None, *, step: int | None = None) -> None:
        """Continue the run a checkpoint of training step ``step`` stored (``None``: a run
        stored outside a checkpoint)."""
        if self.log_with:
            self._tracking().resume(saved, step=step)

    def _exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` as JSON (only after a log call's header disagreed)."""
        return all_gather_json(obj, operation="par.log", timeout_s=self._timeout_s)

    def run_id(self) -> str:
        """The trackers' run id (the main rank's is the job's; a resume's once resumed)."""
        return self._tracking().run_id

    def _tracking(self) -> TrackingRun:
        if self._run is None:
            self._run = TrackingRun(
                check_names(self.log_with),
                self._run_dir or DEFAULT_RUN_DIR,
                is_main=self._is_main,
                describe=self._describe,
            )
        return self._run

    def metered(self, loader: L, train: bool) -> L:
        """``loader``, whose training batches the throughput figure counts (``prepare_loader``)."""
        if train:
            if self._meter is None:
                self._meter = SampleMeter()
            loader.also_on_wait(self._meter.started)
            loader.also_on_batch(self._meter.count)
        return loader

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` that were not training (a profile's trace write) out of the
        samples/s figure."""
        if self._meter is not None:
            self._meter.exclude(seconds)

    def _throughput(self) -> dict[str, float]:
        """Samples/s over every data shard since the last log (main rank; every rank resets)."""
        if self._meter is None:
            return {}
        figures = self._meter.take(self._shard_count())
        return figures if self._is_main else {}

    def close(self) -> None:
        if self._run is not None:
            self._run.close()

    def _share_host(self) -> None:
        """Put this rank's host name in the job's store (read by the main rank's describe)."""
        self._hosts_set = True
        store = _store()
        if store is not None:
            store.set(f"{_HOSTS}/{self._cluster.rank}", _host())

    def _hosts(self) -> list[str]:
        """Every rank's host, in rank order (the first log's gather has passed every set)."""
        store = _store()
        if store is None:
            return [_host()]
        keys = [f"{_HOSTS}/{r}" for r in range(self._cluster.world_size)]
        return [v.decode() for v in store.multi_get(keys)]

    def _describe(self) -> dict[str, Any]:
        """The resolved configuration a new run records once."""
        from manygpu._version import __version__

        hosts = self._hosts()
        return self._facts() | {
            "world_size": self._cluster.world_size,
            "hosts": sorted(set(hosts)),
            "rank_hosts": hosts,
            "manygpu": __version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        }

    def _step_figures(self) -> dict[str, float]:
        """The straggler board's newest per-rank split, once per window (main rank)."""
        if self._reports is None or not self._is_main:
            return {}
        rows = self._reports.table()
        if not rows or rows[0]["window"] == self._logged_window:
            return {}
        self._logged_window = rows[0]["window"]
        out = {}
        for row in rows:
            for name in _SPLIT:
                if row.get(name) is not None:
                    out[f"manygpu/rank{row['rank']}/{name}"] = float(row[name])
        return out


_HOSTS = "manygpu/tracking/hosts"


def _store() -> Any:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _host() -> str:
    return envmod.host_name(envmod.current())
