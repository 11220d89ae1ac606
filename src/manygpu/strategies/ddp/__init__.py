"""``DDP(...)`` (``"ddp"``) and ``Zero1(...)`` (``"zero1"``): replicas, gradients all-reduced.

``DistributedDataParallel`` overlaps the all-reduce with the backward; ZeRO-1
keeps the same gradient path and shards the optimizer state
(``ZeroRedundancyOptimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from manygpu.checkpoint_io.formats import FULL
from manygpu.errors import UsageError
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy

GradCompression = Literal["none", "fp16", "bf16"]


@register
@dataclass(frozen=True, kw_only=True)
class DDP(StrategySpec):
    """``DistributedDataParallel``: one process per device, gradients all-reduced."""

    name: ClassVar[str] = "ddp"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=1, changes_loop=False, checkpoint=FULL, memory=MemoryModel(),
        comm=CommModel(grads="all_reduce"), one_process=False, plan_ways="one",
        mesh_axes=("dp",), hybrid_for="dp",
    )  # fmt: skip

    bucket_cap_mb: float = 25.0
    """Gradient bucket size: bigger buckets, fewer all-reduces, later overlap."""
    find_unused_parameters: bool = False
    """Needed when some parameters get no gradient in a step; costs a graph walk."""
    static_graph: bool = False
    """Promise the graph is the same every step; lets DDP skip work."""
    grad_compression: GradCompression = "none"
    """Compress gradients to fp16/bf16 for the all-reduce (comm hook)."""
    sync_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm stats) to all ranks each forward."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the buckets: saves one copy and memory."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to ``SyncBatchNorm``: statistics over the global
    batch instead of each rank's own (CUDA only: torch has no CPU kernel)."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise UsageError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.grad_compression not in ("none", "fp16", "bf16"):
            raise UsageError(
                f"unknown grad_compression {self.grad_compression!r}; choose none, fp16 or bf16"
            )

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.ddp.strategy import DDPStrategy

        return DDPStrategy


@register
@dataclass(frozen=True, kw_only=True)
class Zero1(DDP):
    """ZeRO-1: DDP's gradients, the optimizer state sharded over the ranks."""

    name: ClassVar[str] = "zero1"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=2, changes_loop=False, checkpoint=FULL, memory=MemoryModel(optimizer="world"),
        comm=CommModel(grads="all_reduce", gather_after_step=True), one_process=False,
        plan_ways="one", mesh_axes=("dp",),
    )  # fmt: skip

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.ddp.zero import Zero1Strategy

        return Zero1Strategy
