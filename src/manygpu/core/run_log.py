"""``par.log``: metrics reduced over the ranks, written to the job's one tracked run.

A mixin, so :class:`~manygpu.Parallel` gains logging in one base class: the
trackers (:mod:`manygpu.tracking`) open on the main rank at the first call, the
configuration they record once is described here (strategy, mesh, precision,
world, versions, hosts), and the straggler board's latest per-rank step split
and the job's samples per second since the last call (:mod:`manygpu.core.throughput`)
ride along with the next call, so those figures reach the trackers without
code of the user's.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from manygpu.comm.objects import all_gather_json
from manygpu.core.throughput import SampleMeter
from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.tracking.reducer import reduce_values
from manygpu.tracking.registry import check_names
from manygpu.tracking.run import TrackingRun

if TYPE_CHECKING:
    from manygpu.core.config import ParallelConfig
    from manygpu.core.data import PreparedLoader
    from manygpu.core.precision import PrecisionChoice
    from manygpu.core.straggler_board import StepReports
    from manygpu.runtime.cluster import ClusterInfo
    from manygpu.strategies.base import Strategy

DEFAULT_RUN_DIR = "runs"
_SPLIT = ("step_ms", "input_ms", "compute_ms", "comm_ms", "link_ms")
"""The straggler board's per-rank figures logged as ``manygpu/rank{r}/{name}``."""


class RunLog:
    """``log``, and the run's state that checkpoints carry."""

    config: ParallelConfig
    cluster: ClusterInfo
    strategy: Strategy[Any]
    strategy_name: str
    precision_choice: PrecisionChoice
    _steps: StepReports | None
    _run: TrackingRun | None = None
    _logged_window: int | None = None
    _hosts_set: bool = False
    _meter: SampleMeter | None = None
    _train_step: int | None = None
    timeout_s: float

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def is_main(self) -> bool:
        raise NotImplementedError

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def _optimizer_steps(self) -> int:
        raise NotImplementedError

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
        job = None if self._train_step is None else max(self._train_step, self._optimizer_steps)
        at = run.next_step(step, job)
        if not self._hosts_set:
            self._share_host()
        reduced = reduce_values(values, reduce, self.gather, self._exchange, self.device)
        run.write(reduced | self._step_figures() | self._throughput(), at)
        return reduced

    def tracking_state(self) -> dict[str, Any] | None:
        """What a checkpoint stores of the run (id, last step); ``None`` without ``log_with``."""
        return None if not self.config.log_with else self._tracking().state()

    def resume_tracking(self, saved: Mapping[str, Any] | None, *, step: int | None = None) -> None:
        """Continue the run a checkpoint of training step ``step`` stored (the checkpointer
        calls it on resume; ``step=None``: a run stored outside a checkpoint)."""
        if step is not None:
            self.note_train_step(step)
        if self.config.log_with:
            self._tracking().resume(saved, step=step)

    def note_train_step(self, step: int) -> None:
        """The Checkpointer saw training step ``step`` (``after_step``, resume): ``step=None``
        logs follow the job's steps from now on."""
        self._train_step = step

    def _exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` as JSON (only after a log call's header disagreed)."""
        return all_gather_json(obj, operation="par.log", timeout_s=self.timeout_s)

    def _preflight_tracking(self) -> None:
        """``Parallel.__init__``: a missing extra (every rank) or a tracker that cannot open
        its store (the main rank, which writes) fails now, before any training."""
        if self.config.log_with:
            self._tracking().preflight()

    def _tracking_run_id(self) -> str:
        """The trackers' run id (the main rank's is the job's; a resume's once resumed)."""
        return self._tracking().run_id

    def _tracking(self) -> TrackingRun:
        if self._run is None:
            self._run = TrackingRun(
                check_names(self.config.log_with),
                self.config.run_dir or DEFAULT_RUN_DIR,
                is_main=self.is_main,
                describe=self._describe,
            )
        return self._run

    def _metered(self, loader: PreparedLoader, train: bool) -> PreparedLoader:
        """``loader``, whose training batches the throughput figure counts (``prepare_loader``)."""
        if train:
            if self._meter is None:
                self._meter = SampleMeter()
            loader.also_on_wait(self._meter.started)
            loader.also_on_batch(self._meter.count)
        return loader

    def _throughput(self) -> dict[str, float]:
        """Samples/s over every data shard since the last log (main rank; every rank resets)."""
        if self._meter is None:
            return {}
        figures = self._meter.take(self.strategy.data_shard()[1])
        return figures if self.is_main else {}

    def _close_tracking(self) -> None:
        if self._run is not None:
            self._run.close()

    def _share_host(self) -> None:
        """Put this rank's host name in the job's store (read by the main rank's describe)."""
        self._hosts_set = True
        store = _store()
        if store is not None:
            store.set(f"{_HOSTS}/{self.cluster.rank}", _host())

    def _hosts(self) -> list[str]:
        """Every rank's host, in rank order (the first log's gather has passed every set)."""
        store = _store()
        if store is None:
            return [_host()]
        keys = [f"{_HOSTS}/{r}" for r in range(self.cluster.world_size)]
        return [v.decode() for v in store.multi_get(keys)]

    def _describe(self) -> dict[str, Any]:
        """The resolved configuration a new run records once."""
        from manygpu._version import __version__

        hosts = self._hosts()
        return {
            "strategy": self.strategy_name,
            "strategy_options": repr(self.strategy),
            "mesh": repr(self.config.mesh) if self.config.mesh is not None else None,
            "precision": self.precision_choice.precision,
            "world_size": self.cluster.world_size,
            "hosts": sorted(set(hosts)),
            "rank_hosts": hosts,
            "manygpu": __version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "grad_accum_steps": self.config.grad_accum_steps,
        }

    def _step_figures(self) -> dict[str, float]:
        """The straggler board's newest per-rank split, once per window (main rank)."""
        if self._steps is None or not self.is_main:
            return {}
        rows = self._steps.table()
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
