"""The parts ``Parallel`` is made of, built once its strategy is, each given what it needs.

Each part gets its inputs in its constructor (no part reaches into
``Parallel``); what can change after ``Parallel()`` (``strategy="auto"``
decides again at the first ``prepare``) is read through :class:`Current`.
The step event's listeners are registered here, in one place, and run in the
order :mod:`.steps` fixes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manygpu.core.accumulation import Accumulator
from manygpu.core.config import ParallelConfig
from manygpu.core.console import MainConsole
from manygpu.core.job_comm import JobCollectives
from manygpu.core.job_state import JobState
from manygpu.core.precision import PrecisionChoice, PrecisionPlugin
from manygpu.core.preparing import Preparer
from manygpu.core.steps import StepEvents
from manygpu.observe import straggler_board
from manygpu.observe.job_log import JobLog
from manygpu.observe.profiling import Profiler
from manygpu.runtime import env as envmod
from manygpu.runtime import ray_train
from manygpu.runtime.cluster import ClusterInfo
from manygpu.strategies import Strategy, abilities

if TYPE_CHECKING:
    from manygpu.checkpoint_io.formats import Parts


@dataclass
class Current:
    """The job's strategy and its registry name (``"auto"`` may replace both once)."""

    name: str
    strategy: Strategy[Any]


@dataclass(frozen=True)
class JobParts:
    """Everything a ``Parallel`` delegates to."""

    accumulator: Accumulator
    console: MainConsole
    events: StepEvents
    reports: straggler_board.StepReports | None
    collectives: JobCollectives
    job_log: JobLog
    profiler: Profiler
    job_state: JobState
    prep: Preparer


@dataclass(frozen=True)
class JobFacts:
    """The facts of the job the parts are built for."""

    config: ParallelConfig
    cluster: ClusterInfo
    is_main: bool
    device: torch.device
    timeout_s: float
    precision: PrecisionPlugin
    choice: PrecisionChoice


def assemble(current: Current, job: JobFacts, environ: envmod.Environ) -> JobParts:
    """The job's parts, wired: the step event's listeners, logging, profiling, prepare."""
    config, cluster = job.config, job.cluster
    console = MainConsole(job.is_main, cluster.rank)
    if ray_train.active():
        console.print(ray_train.started_line(job.timeout_s), markup=False)
    events = StepEvents()
    reports = straggler_board.start(
        straggler_board.steps_every(config.stragglers, environ), cluster.rank,
        cluster.world_size, local_rank=cluster.local_rank,
        peers=abilities.timing_peers(current.strategy), is_main=job.is_main,
    )  # fmt: skip
    if reports is not None:
        events.on_step("clock", lambda _step: reports.clock.step())
    if job.precision.fp8 is not None:
        events.on_step("fp8", job.precision.fp8.after_step, every_optimizer=True)
    collectives = JobCollectives(
        strategy=lambda: current.strategy, device=job.device,
        timeout_s=job.timeout_s, debug=config.debug,
    )  # fmt: skip
    job_log = JobLog(
        log_with=tuple(config.log_with or ()), run_dir=config.run_dir, cluster=cluster,
        is_main=job.is_main, device=job.device, timeout_s=job.timeout_s,
        gather=collectives.gather, facts=functools.partial(facts, current, job),
        shard_count=lambda: current.strategy.data_shard()[1],
        job_step=lambda: events.job_step, reports=reports,
    )  # fmt: skip
    profiler = Profiler(
        rank=cluster.rank, device=job.device, timeout_s=job.timeout_s, run_dir=config.run_dir,
        run_id=job_log.run_id if config.log_with else None, steps_done=lambda: events.done,
        say=lambda line: console.print(line, markup=False),
        paused=functools.partial(_not_training, job_log, reports),
    )  # fmt: skip
    events.on_step("profiler", profiler.after_step)
    state = JobState(events=events, log=job_log, parts=functools.partial(parts, current, job))
    accumulator = Accumulator(config.grad_accum_steps)
    prep = Preparer(
        strategy=lambda: current.strategy, config=config, device=job.device,
        timeout_s=job.timeout_s, precision=job.precision, accumulator=accumulator,
        events=events, reports=reports, job_log=job_log, say=console.print,
        is_main=job.is_main,
    )  # fmt: skip
    return JobParts(
        accumulator, console, events, reports, collectives, job_log, profiler, state, prep
    )


def _not_training(
    job_log: JobLog, reports: straggler_board.StepReports | None, seconds: float
) -> None:
    """``seconds`` after a step went to a profile window's own work (its trace written):
    out of the samples/s figure and the step clock, so one step's write does not read
    as a step 30 times slower."""
    job_log.exclude(seconds)
    if reports is not None:
        reports.clock.exclude(seconds)


def facts(current: Current, job: JobFacts) -> dict[str, Any]:
    """The resolved configuration a new tracked run records once."""
    mesh = job.config.mesh
    return {
        "strategy": current.name,
        "strategy_options": repr(current.strategy),
        "mesh": repr(mesh) if mesh is not None else None,
        "precision": job.choice.precision,
        "grad_accum_steps": job.config.grad_accum_steps,
    }


def parts(
    current: Current, job: JobFacts, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> Parts:
    """What a checkpoint of the prepared ``model`` and (inner) ``optimizer`` holds."""
    # Imported here: `import manygpu` must not pay for the checkpoint package.
    from manygpu.checkpoint_io.formats import Parts, as_format

    strategy = current.strategy
    return Parts(
        format=as_format(strategy.checkpoint_format),
        model=strategy.unwrap(model),
        wrapped=model,
        optimizer=optimizer,
        scaler=job.precision.scaler,
        consolidate=functools.partial(abilities.consolidate, strategy),
        seed=job.config.seed,
        strategy=current.name,
        precision=job.choice.precision,
    )
