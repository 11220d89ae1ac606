"""Building the job's strategy: the one sequence, for the first choice and for ``"auto"``'s.

``Parallel()`` decides a strategy before it knows the model (the name the
config and the launcher give; ``"auto"``'s provisional one), and ``"auto"``
decides again in ``prepare`` once the planner has seen the model. Both go
through :func:`chosen_strategy` (the options object, the class, the
launcher's say) and :func:`checked` (the class's own checks of the world and
of the job's features), so a strategy built either way is refused for the
same reasons with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from manygpu.core.config import ParallelConfig, served_class
from manygpu.core.precision import PrecisionChoice, cuda_facts, resolve_precision
from manygpu.runtime import env as envmod
from manygpu.runtime import host_memory
from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.device import choose_backend, choose_device, set_cpu_threads
from manygpu.runtime.process_group import DistContext, init_distributed
from manygpu.strategies import Strategy, StrategySpec, abilities
from manygpu.strategies.base import JobOptions


@dataclass(frozen=True)
class Chosen:
    """A strategy decided but not yet built: its name, class and options."""

    name: str
    cls: type[Strategy[Any]]
    options: StrategySpec


def chosen_strategy(config: ParallelConfig, name: str, environ: envmod.Environ) -> Chosen:
    """Strategy ``name``'s options (the script's object, else its defaults), its class
    (a ``--ps`` launch admits only a serving one) and what the launcher decided."""
    options = config.strategy_object(name)
    cls = served_class(options, envmod.launched_servers(environ))
    return Chosen(name, cls, options.launched(environ))


def checked(
    chosen: Chosen, config: ParallelConfig, cluster: ClusterInfo, precision: str
) -> JobOptions:
    """The job's options for ``chosen`` after its class's checks of the world and of
    the features asked for (each refusal one line naming the fix)."""
    job = config.job_options(precision)
    chosen.cls.validate_world(cluster, chosen.options, job)
    chosen.cls.validate_features(chosen.options, job)
    return job


def device_and_precision(
    chosen: Chosen, config: ParallelConfig, cluster: ClusterInfo, environ: envmod.Environ
) -> tuple[torch.device, str, PrecisionChoice]:
    """This rank's device (the strategy's slot among the node's GPUs; none: the CPU),
    its name, and what ``precision=`` becomes there (``"auto"`` resolved)."""
    slot = abilities.device_slot(chosen.cls, cluster, chosen.options)
    if slot is None:
        device = torch.device("cpu")
    else:
        device = choose_device(slot, config.device, envmod.gpus_bound_per_task(environ))
    capability, name = cuda_facts(device)
    choice = resolve_precision(
        config.precision, device_type=device.type, capability=capability,
        refused=chosen.cls.refused_precisions, fp8_emulate=envmod.fp8_emulate(environ),
    )  # fmt: skip
    return device, name, choice


def joined(
    chosen: Chosen,
    cluster: ClusterInfo,
    job: JobOptions,
    device: torch.device,
    config: ParallelConfig,
    timeout_s: float,
    environ: envmod.Environ,
) -> DistContext:
    """This process bound to its device (its GPU, or its share of the CPU's threads)
    and joined to the job's process group as the strategy's role needs."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        set_cpu_threads(cluster.local_world_size, environ)
    return abilities.join(
        chosen.cls, cluster, chosen.options, job, device=device,
        backend=choose_backend(device, config.backend), timeout_s=timeout_s,
    )  # fmt: skip


def rebuilt(
    name: str, config: ParallelConfig, ctx: DistContext, precision: str, timeout_s: float
) -> tuple[DistContext, Strategy[Any]]:
    """Strategy ``name`` in place of ``"auto"``'s provisional one: its own checks and
    group needs (a one-process job gets a group when the new strategy needs one)."""
    chosen = chosen_strategy(config, name, envmod.current())
    job = checked(chosen, config, ctx.cluster, precision)
    if chosen.cls.needs_process_group and not ctx.owns_group and ctx.cluster.world_size == 1:
        ctx = init_distributed(
            ctx.cluster, device=ctx.device, backend=ctx.backend, timeout_s=timeout_s,
            force=True,
        )  # fmt: skip
    strategy = chosen.cls(ctx, chosen.options, job)
    keep_host_memory_low(strategy, envmod.current())
    return ctx, strategy


@dataclass(frozen=True)
class Started:
    """A job's strategy built and joined, with what ``Parallel`` keeps of the way there."""

    chosen: Chosen
    strategy: Strategy[Any]
    ctx: DistContext
    choice: PrecisionChoice
    device_name: str
    """For the precision announcement."""
    timeout_s: float


def started(config: ParallelConfig, cluster: ClusterInfo, environ: envmod.Environ) -> Started:
    """The strategy the config and the launcher ask for, checked, on its device, joined."""
    name = config.resolved_strategy(
        cluster.world_size, served=envmod.launched_servers(environ) is not None
    )
    chosen = chosen_strategy(config, name, environ)
    device, device_name, choice = device_and_precision(chosen, config, cluster, environ)
    job = checked(chosen, config, cluster, choice.precision)
    timeout_s = config.timeout_s or envmod.timeout_s(environ)
    ctx = joined(chosen, cluster, job, device, config, timeout_s, environ)
    strategy = chosen.cls(ctx, chosen.options, job)
    keep_host_memory_low(strategy, environ)
    return Started(chosen, strategy, ctx, choice, device_name, timeout_s)


def keep_host_memory_low(strategy: Strategy[Any], environ: envmod.Environ) -> None:
    """A strategy that splits the weights gets a fixed glibc mmap threshold, before the
    model is built: freed blocks then leave the resident set (the user's own malloc
    settings win). It costs a CPU step 20-50% more CPU time (BENCHMARKS.md), so the
    replicating strategies, whose memory it would not change, keep glibc's defaults."""
    if strategy.card.memory.weights != "whole":
        host_memory.fix_mmap_threshold(envmod.user_set_malloc(environ))
