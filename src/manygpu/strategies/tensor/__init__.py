"""``Tensor(plan=...)`` (``"tensor"``): each Linear split over the ``tp`` ranks (Megatron-style).

With ``dp``/``fsdp`` mesh dimensions the tensor-parallel model is also sharded
over the data ranks (FSDP2 on top, with :attr:`Tensor.fsdp`'s knobs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from manygpu.checkpoint_io.formats import DCP
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.fsdp import FSDP
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy


@register
@dataclass(frozen=True, kw_only=True)
class Tensor(StrategySpec):
    """Tensor parallelism over ``tp`` (optionally x dp / fsdp)."""

    name: ClassVar[str] = "tensor"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=6, changes_loop=True, checkpoint=DCP,
        memory=MemoryModel(weights="ways", grads="ways", optimizer="ways",
                           activations="tp_sharded"),
        comm=CommModel(replica="ways", split="layer_shards"), one_process=False,
        plan_ways="axis", ways_option="tp", mesh_axes=("dp", "fsdp", "tp"), mesh_default="tp",
        hybrid_for="tp",
    )  # fmt: skip

    plan: Mapping[str, Any] | None = None
    """Module path -> ``"colwise"``, ``"rowwise"`` or a torch ``ParallelStyle``.
    ``None`` finds a plan for common patterns (q/k/v/out projections, fc1/fc2,
    w1/w2/w3, Linear-act-Linear in a Sequential)."""
    fsdp: FSDP = field(default_factory=FSDP)
    """FSDP2's knobs over the mesh's data dimensions, when it has them."""

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.tensor.strategy import TensorParallelStrategy

        return TensorParallelStrategy
