"""Every strategy's card: where its class lives, and what the planner must know of it.

This is the one list of strategies. The planner's candidates, ``"auto"``'s
choices, the default strategy and the checkpoint format all derive from it, so
no code outside ``strategies/`` branches on a name. A strategy's class is
imported only when it is looked up: FSDP, DTensor and pipelining are loaded by
the jobs that use them, not by every ``import manygpu``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from manygpu.checkpoint.formats import DCP, FULL, Format
from manygpu.errors import UsageError
from manygpu.strategies.costs import CommModel, MemoryModel

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy

Ways = Literal["one", "local_devices", "node_divisors", "divisors", "servers", "never"]


@dataclass(frozen=True, kw_only=True)
class StrategyCard:
    """What is known of a strategy without importing it."""

    name: str
    where: str
    """``module:Class``, imported on lookup."""
    simplicity: int
    """Tie-break rank when the planner finds two equally fast: fewer moving parts first."""
    changes_loop: bool
    """Needs options or a loop the user must write for it (a loss function, a
    plan, outputs on another device): ``"auto"`` never picks it silently."""
    checkpoint: Format
    """``FULL``: one copy from the main rank (replicated state); ``DCP``: shards."""
    memory: MemoryModel
    comm: CommModel
    one_process: bool
    """One process drives every device it uses (a candidate for a one-process job)."""
    plan_ways: Ways
    """Model-split sizes the planner tries: none (``one``), 2..GPUs of a node
    (``local_devices``), divisors of the world within a node (``node_divisors``)
    or across nodes (``divisors``), server counts (``servers``: 1, 2, 4... up to
    half the world); ``never``: not a planner candidate."""
    serves: bool = False
    """Its first ranks serve the others (parameter servers): ``manygpu launch
    --ps K`` picks it when the script names no strategy."""


_DP = CommModel(grads="all_reduce")
_CARDS: tuple[StrategyCard, ...] = (
    StrategyCard(name="single", where="manygpu.strategies.single:SingleDevice", simplicity=0,
                 changes_loop=False, checkpoint=FULL, memory=MemoryModel(),
                 comm=CommModel(replica="one_process", grads="none"), one_process=True,
                 plan_ways="one"),
    StrategyCard(name="ddp", where="manygpu.strategies.ddp:DDPStrategy", simplicity=1,
                 changes_loop=False, checkpoint=FULL, memory=MemoryModel(), comm=_DP,
                 one_process=False, plan_ways="one"),
    StrategyCard(name="zero1", where="manygpu.strategies.zero:Zero1Strategy", simplicity=2,
                 changes_loop=False, checkpoint=FULL, memory=MemoryModel(optimizer="world"),
                 comm=CommModel(grads="all_reduce", gather_after_step=True), one_process=False,
                 plan_ways="one"),
    StrategyCard(name="zero2", where="manygpu.strategies.fsdp:Zero2Strategy", simplicity=3,
                 changes_loop=False, checkpoint=DCP,
                 memory=MemoryModel(grads="world", optimizer="world"),
                 comm=CommModel(grads="reduce_scatter", weight_gathers=1), one_process=False,
                 plan_ways="one"),
    StrategyCard(name="fsdp", where="manygpu.strategies.fsdp:FSDPStrategy", simplicity=4,
                 changes_loop=False, checkpoint=DCP,
                 memory=MemoryModel(weights="world", grads="world", optimizer="world",
                                    gathered_unit=True),
                 comm=CommModel(grads="reduce_scatter", weight_gathers=2), one_process=False,
                 plan_ways="one"),
    StrategyCard(name="model", where="manygpu.strategies.model:ModelParallelStrategy",
                 simplicity=5, changes_loop=True, checkpoint=FULL,
                 memory=MemoryModel(weights="ways", grads="ways", optimizer="ways",
                                    activations="ways"),
                 comm=CommModel(replica="one_process", grads="none"), one_process=True,
                 plan_ways="local_devices"),
    StrategyCard(name="tensor", where="manygpu.strategies.tensor:TensorParallelStrategy",
                 simplicity=6, changes_loop=True, checkpoint=DCP,
                 memory=MemoryModel(weights="ways", grads="ways", optimizer="ways"),
                 comm=CommModel(replica="ways", split="layer_shards"), one_process=False,
                 plan_ways="node_divisors"),
    StrategyCard(name="pipeline", where="manygpu.strategies.pipeline:PipelineStrategy",
                 simplicity=7, changes_loop=True, checkpoint=DCP,
                 memory=MemoryModel(weights="ways", grads="ways", optimizer="ways",
                                    activations="in_flight"),
                 comm=CommModel(replica="ways", split="stages"), one_process=False,
                 plan_ways="divisors"),
    # nn.DataParallel: slower than ddp on every shape (one Python thread
    # scatters and gathers, replicas rebuilt each step); kept for the tutorials.
    StrategyCard(name="dp", where="manygpu.strategies.dp:DataParallelStrategy", simplicity=8,
                 changes_loop=False, checkpoint=FULL, memory=MemoryModel(),
                 comm=_DP, one_process=True, plan_ways="never"),
    # Parameter servers: the loop is unchanged, but the job's first ranks serve
    # instead of training, so "auto" never picks it; workers keep whole weights
    # and gradients, the servers the optimizer state (split over `ways` of them:
    # an upper bound for either role). Gradients go whole to the servers after
    # the backward and the weights come back: exposed, not overlapped.
    StrategyCard(name="ps", where="manygpu.strategies.ps:ParameterServerStrategy",
                 simplicity=9, changes_loop=True, checkpoint=FULL,
                 memory=MemoryModel(optimizer="ways"), comm=CommModel(grads="push_pull"),
                 one_process=False, plan_ways="servers", serves=True),
)  # fmt: skip
_BY_NAME = {card.name: card for card in _CARDS}


def available() -> list[str]:
    """Registered strategy names, sorted."""
    return sorted(_BY_NAME)


def cards() -> tuple[StrategyCard, ...]:
    """Every card, simplest first."""
    return tuple(sorted(_CARDS, key=lambda c: c.simplicity))


def card(name: str) -> StrategyCard:
    """The card of ``name``; a clear error for unknown names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UsageError(
            f"unknown strategy {name!r}; choose one of: {', '.join(available())}"
        ) from None


def get_strategy(name: str) -> type[Strategy]:
    """The class registered as ``name``, imported now."""
    module, _, attr = card(name).where.partition(":")
    cls: type[Strategy] = getattr(importlib.import_module(module), attr)
    return cls


def default_strategy(world_size: int) -> str:
    """What runs when none is named: the simplest unchanged loop for this many processes."""
    fits = [c for c in cards() if not c.changes_loop and c.plan_ways != "never"]
    return next(c.name for c in fits if c.one_process == (world_size == 1))


def serving_strategy() -> str:
    """The strategy whose first ranks serve the others (what ``--ps K`` launches)."""
    return next(c.name for c in cards() if c.serves)


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator: bind a strategy class to its card (which must exist)."""

    def wrap(cls: type[Strategy]) -> type[Strategy]:
        entry = card(name)
        if entry.where != f"{cls.__module__}:{cls.__qualname__}":
            raise ValueError(f"strategy {name!r} is carded at {entry.where}, not {cls.__module__}")
        cls.name = name
        cls.card = entry
        cls.checkpoint_format = entry.checkpoint
        cls.multi_process = not entry.one_process
        return cls

    return wrap
