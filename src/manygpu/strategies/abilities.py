"""What only some strategies do, asked for by capability, never by name.

The base interface (:class:`~.base.Strategy`) is what every strategy needs to
wrap a model and its optimizer. A strategy that also places its ranks in roles,
clips where the gradients are combined, splits the gradient norm over a group,
shards its optimizer outside DCP, reports a progress note, times its steps
against some peers only, tells its communication apart from compute, or holds
something to release, defines the matching methods of a protocol below. The
functions here ask for each ability and otherwise do the plain thing, so
:class:`~manygpu.Parallel` calls them without knowing which strategy it drives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.process_group import DistContext, init_distributed

if TYPE_CHECKING:
    from manygpu.strategies.base import JobOptions, Strategy
    from manygpu.strategies.spec import StrategySpec

CommProbe = Callable[[], "tuple[int, float] | None"]
"""See :meth:`ProbesComm.comm_probe`."""


@runtime_checkable
class PlacesRanks(Protocol):
    """Ranks with roles (parameter servers): the class places each rank and forms the groups.

    Class-level: both are asked before the strategy object exists. Its instance on a
    rank that serves the others (and never runs the loop: its ``prepare`` ends the
    process once the workers are done) says so with a true ``is_server`` attribute.
    """

    @classmethod
    def device_slot(cls, cluster: ClusterInfo, options: Any) -> int | None:
        """Which of this node's GPUs this rank drives (``None``: it runs on the CPU)."""

    @classmethod
    def join(
        cls, cluster: ClusterInfo, options: Any, job: JobOptions, *,
        device: torch.device, backend: str, timeout_s: float,
    ) -> DistContext:  # fmt: skip
        """Join the job's groups; the context's ``cluster`` is the job as this rank sees it."""


@runtime_checkable
class ClipsCombined(Protocol):
    """Gradients are combined after the backward (parameter servers): clip them there."""

    def combined_clip(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        """Clip where the gradients are combined and return the norm; ``None``: clip here."""


@runtime_checkable
class SplitsNorm(Protocol):
    """Ranks hold different parameters as plain tensors (pipeline stages)."""

    def grad_norm_group(self) -> object | None:
        """The group over which the gradient norm's pieces are summed."""


@runtime_checkable
class ConsolidatesOptimizer(Protocol):
    """The optimizer's state is sharded outside DCP (ZeRO-1, parameter servers)."""

    def consolidate_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.state_dict()`` whole on the main rank (every rank calls it)."""


@runtime_checkable
class ReportsStatus(Protocol):
    """Has a line of progress worth showing beside the bar."""

    def status(self) -> str | None:
        """One line for the main process's bar after each step (``None``: none)."""


@runtime_checkable
class TimesAmongPeers(Protocol):
    """Its ranks do different work (pipeline stages): compare each with its likes only."""

    def timing_peers(self) -> int:
        """Ranks whose steps do comparable work share this label."""


@runtime_checkable
class ProbesComm(Protocol):
    """Can tell its exposed communication apart from compute (DDP's buckets)."""

    def comm_probe(self, module: nn.Module, every: int) -> CommProbe | None:
        """How to read the exposed communication of a sampled step of ``module``: the
        probe returns (the step's start in ``time.time_ns()``, seconds) for a step
        sampled since its last call, else ``None``; it is called every ``every`` steps."""


@runtime_checkable
class Releases(Protocol):
    """Holds hooks, groups or connections to release when the job closes."""

    def teardown(self) -> None:
        """Release them."""


# -- asking ----------------------------------------------------------------------------


def device_slot(
    cls: type[Strategy[Any]], cluster: ClusterInfo, options: StrategySpec
) -> int | None:
    """This rank's GPU on its node: the strategy's placement, else its local rank's."""
    if isinstance(cls, PlacesRanks):
        return cls.device_slot(cluster, options)
    return cluster.local_rank


def join(
    cls: type[Strategy[Any]], cluster: ClusterInfo, options: StrategySpec, job: JobOptions,
    *, device: torch.device, backend: str, timeout_s: float,
) -> DistContext:  # fmt: skip
    """The strategy's groups, else one group over every rank (made even for one process
    when the strategy needs it)."""
    if isinstance(cls, PlacesRanks):
        return cls.join(cluster, options, job, device=device, backend=backend, timeout_s=timeout_s)
    return init_distributed(
        cluster, device=device, backend=backend, timeout_s=timeout_s,
        force=cls.needs_process_group,
    )  # fmt: skip


def is_server(strategy: object) -> bool:
    """Whether this process serves the others instead of training: this rank's role.

    Not the card's ``serves`` (:class:`~manygpu.strategies.registry.StrategyCard`),
    which says the strategy's first ranks serve, whichever rank asks."""
    return bool(getattr(strategy, "is_server", False))


def backpropagated_loss_scale(strategy: object) -> float | None:
    """For a strategy whose model runs its own backward (a pipeline's schedule): what that
    backward divided the summed losses by, so ``par.backward(loss, tokens=n)`` can undo
    it; ``None`` for a strategy that backpropagates the loss ``par.backward`` is given."""
    scale = getattr(strategy, "backpropagated_loss_scale", None)
    return float(scale()) if callable(scale) else None


def combined_clip(
    strategy: object, parameters: list[torch.Tensor], max_norm: float, norm_type: float
) -> torch.Tensor | None:
    """The norm clipped where gradients are combined, or ``None``: clip locally."""
    if isinstance(strategy, ClipsCombined):
        return strategy.combined_clip(parameters, max_norm, norm_type)
    return None


def grad_norm_group(strategy: object) -> object | None:
    """Where the gradient norm's plain-tensor pieces are summed (``None``: they are whole)."""
    return strategy.grad_norm_group() if isinstance(strategy, SplitsNorm) else None


def consolidate(strategy: object, optimizer: torch.optim.Optimizer) -> None:
    """Gather a sharded optimizer's state on the main rank, where it is sharded outside DCP."""
    if isinstance(strategy, ConsolidatesOptimizer):
        strategy.consolidate_optimizer(optimizer)


def status(strategy: object) -> str | None:
    """The strategy's progress note, if it has one."""
    return strategy.status() if isinstance(strategy, ReportsStatus) else None


def timing_peers(strategy: object) -> int:
    """The label of the ranks this one's step times are compared with (0: all)."""
    return strategy.timing_peers() if isinstance(strategy, TimesAmongPeers) else 0


def comm_probe(strategy: object, module: nn.Module, every: int) -> CommProbe | None:
    """The strategy's communication probe (``None``: communication counts as compute)."""
    return strategy.comm_probe(module, every) if isinstance(strategy, ProbesComm) else None


def release(strategy: object) -> None:
    """Release what the strategy holds, if anything."""
    if isinstance(strategy, Releases):
        strategy.teardown()
