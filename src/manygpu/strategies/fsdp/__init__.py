"""``FSDP(...)`` (``"fsdp"``, ZeRO-3) and ``Zero2(...)`` (``"zero2"``): FSDP2 ``fully_shard``.

Parameters, gradients and optimizer state are sharded over the data ranks;
``Zero2`` keeps the gathered parameters from the forward to the backward
(less communication, more memory). ``mesh={"dp": nodes, "fsdp": gpus}`` is
HSDP: sharded within a node, replicated across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from torch.nn import Module

from manygpu.checkpoint_io.formats import DCP
from manygpu.errors import UsageError
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, preset, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy

ShardDtype = Literal["fp32", "bf16", "fp16"] | None


@register
@dataclass(frozen=True, kw_only=True)
class FSDP(StrategySpec):
    """ZeRO-3 through FSDP2: every rank holds 1/N of parameters, grads and optimizer state."""

    name: ClassVar[str] = "fsdp"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=4, changes_loop=False, checkpoint=DCP,
        memory=MemoryModel(weights="world", grads="world", optimizer="world", gathered="unit",
                           compute_dtype_option="param_dtype"),
        comm=CommModel(grads="reduce_scatter", weight_gathers=2), one_process=False,
        plan_ways="one", mesh_axes=("dp", "fsdp"), mesh_default="fsdp", hybrid_for="fsdp",
    )  # fmt: skip
    param_dtype: ShardDtype = None
    """Compute dtype of the gathered parameters (mixed precision); ``None`` keeps them."""
    reduce_dtype: ShardDtype = None
    """Dtype of the gradient reduce-scatter; ``None`` = the parameters' dtype."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (ZeRO-3), to gather them
    again for its backward; ``False`` keeps them (less traffic, more memory): that is
    ``Zero2``, a preset of this option registered as ``"zero2"``."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""
    shard_children: bool = True
    """Shard each block as its own unit (overlap and lower peak memory): the
    members of layer containers (``nn.ModuleList`` of transformer blocks), or
    the direct children of a model without one; tied weights stay in one unit.
    ``False`` makes the whole model one unit."""
    block_classes: tuple[type | str, ...] | type | str = ()
    """The block class(es) to shard as units instead, by class or class name,
    e.g. ``"LlamaDecoderLayer"`` (outermost matches; the root takes the rest)."""

    def __post_init__(self) -> None:
        if isinstance(self.block_classes, (str, type)):
            object.__setattr__(self, "block_classes", (self.block_classes,))
        for cls in self.block_classes:  # type: ignore[union-attr]
            if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, Module)):
                raise UsageError(
                    f"block_classes takes nn.Module classes or class names, not {cls!r}"
                )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in (None, "fp32", "bf16", "fp16"):
                raise UsageError(f"unknown {name} {value!r}; choose fp32, bf16 or fp16")

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.fsdp.strategy import FSDPStrategy

        return FSDPStrategy


Zero2 = preset(
    "Zero2", FSDP, name="zero2", reshard_after_forward=False,
    card=StrategyCard(
        simplicity=3, changes_loop=False, checkpoint=DCP,
        memory=MemoryModel(weights="world", grads="world", optimizer="world", gathered="whole",
                           compute_dtype_option="param_dtype"),
        comm=CommModel(grads="reduce_scatter", weight_gathers=1), one_process=False,
        plan_ways="one", mesh_axes=("dp", "fsdp"), mesh_default="fsdp",
    ),
)  # fmt: skip
"""ZeRO-2 through FSDP2: ``FSDP`` whose parameters stay gathered between forward and
backward (``reshard_after_forward=False``), with its own name and cost card."""
