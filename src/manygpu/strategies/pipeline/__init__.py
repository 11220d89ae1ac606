"""``Pipeline(loss_fn=..., microbatches=8)`` (``"pipeline"``): stages streamed over ranks.

One stage per rank (``gpipe``, ``1f1b``) or several (``interleaved-1f1b``,
``interleaved-zero-bubble``, ``zbv``, ``dualpipev``: see :mod:`.schedules`).

With ``dp``/``fsdp`` mesh dimensions each stage is also sharded over its data
ranks (FSDP2, with :attr:`Pipeline.fsdp`'s knobs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from manygpu.checkpoint_io.formats import DCP
from manygpu.errors import UsageError
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.fsdp import FSDP
from manygpu.strategies.pipeline.schedules import SCHEDULES, virtual_refusal
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy

PipelineSchedule = Literal[
    "gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv", "dualpipev"
]
Balance = Literal["params", "time"]


@register
@dataclass(frozen=True, kw_only=True)
class Pipeline(StrategySpec):
    """Pipeline parallelism (``torch.distributed.pipelining``) over ``pp`` (x dp / fsdp)."""

    name: ClassVar[str] = "pipeline"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=7, changes_loop=True, checkpoint=DCP,
        memory=MemoryModel(weights="ways", grads="ways", optimizer="ways", activations="in_flight"),
        comm=CommModel(replica="ways", split="stages"), one_process=False, plan_ways="axis",
        ways_option="pp", required_options=("loss_fn=...",), mesh_axes=("pp", "dp", "fsdp"),
        mesh_default="pp", hybrid_for="pp",
    )  # fmt: skip

    loss_fn: Callable[[Any, Any], Any] | None = None
    """``loss_fn(output, target)`` run on the last stage per micro-batch
    (mean-reduced losses give the same gradients as one big batch). Required
    for training: ``loss = model(x, target=y)`` runs forward and backward."""
    microbatches: int = 4
    """Micro-batches per batch; the batch size must be a multiple of it."""
    schedule: PipelineSchedule = "1f1b"
    """``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (activation
    memory bounded by the stage count, not the micro-batch count), or one with
    several stages per rank and a smaller bubble: ``"interleaved-1f1b"``,
    ``"interleaved-zero-bubble"`` (``virtual_stages`` per rank, looped),
    ``"zbv"``, ``"dualpipev"`` (two per rank, in a V)."""
    virtual_stages: int | None = None
    """Stages per rank for the interleaved schedules (default 2); the model is cut
    into ``pp x virtual_stages`` stages."""
    split_points: tuple[int, ...] | None = None
    """Indices into the ``nn.Sequential`` where stages 1.. begin (``None``: automatic);
    ``pp x virtual_stages - 1`` of them."""
    balance: Balance = "params"
    """Automatic split by parameter count, or by measured time per layer
    (``"time"`` needs ``example_input``)."""
    example_input: Any = None
    """A batch-shaped input, used to time layers for ``balance="time"``."""
    fsdp: FSDP = field(default_factory=FSDP)
    """FSDP2's knobs over the mesh's data dimensions, when it has them."""

    def __post_init__(self) -> None:
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise UsageError(f"microbatches must be an integer >= 1, got {self.microbatches!r}")
        if self.schedule not in SCHEDULES:
            names = ", ".join(SCHEDULES)
            raise UsageError(f"unknown pipeline schedule {self.schedule!r}; choose one of {names}")
        refusal = virtual_refusal(self.schedule, self.virtual_stages)
        if refusal:
            raise UsageError(refusal)
        if self.balance not in ("params", "time"):
            raise UsageError(f"unknown balance {self.balance!r}; choose params or time")
        if self.balance == "time" and self.example_input is None and self.split_points is None:
            raise UsageError("balance='time' times each layer: give example_input (one batch)")

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.pipeline.strategy import PipelineStrategy

        return PipelineStrategy
