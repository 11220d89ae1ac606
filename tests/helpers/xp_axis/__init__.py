"""A mesh axis and a strategy that composes it, from outside manygpu's tree.

What adding context or expert parallelism takes: one entry in the axis table
(:func:`manygpu.strategies.axes.add_axis`) and one strategy package whose card
names the axis. The ratchet test (tests/unit/test_mesh_axes.py) imports this
package and checks the mesh, the refusals, ``strategy="hybrid"`` and the
planner know the axis without any other change. The strategy moves the model
to its device and leaves the split to a real implementation: the point is the
wiring, not the parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from manygpu.checkpoint_io.formats import DCP
from manygpu.strategies.axes import MeshAxis, add_axis
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy

XP = MeshAxis(name="xp", order=35, splits_data=False, in_node=True, doc="expert shards")
"""Between the data shards and tensor parallelism, inside a node (as torchtitan's ep)."""

add_axis(XP)


@register
@dataclass(frozen=True, kw_only=True)
class ExpertSplit(StrategySpec):
    """Experts split over ``xp`` (optionally x dp / fsdp)."""

    name: ClassVar[str] = "toy-xp"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=60, changes_loop=True, checkpoint=DCP,
        memory=MemoryModel(weights="ways", grads="ways", optimizer="ways"),
        comm=CommModel(replica="ways", split="layer_shards"), one_process=False,
        plan_ways="axis", ways_option="xp", mesh_axes=("dp", "fsdp", "xp"), mesh_default="xp",
        hybrid_for="xp",
    )  # fmt: skip

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from xp_axis.work import ExpertSplitStrategy

        return ExpertSplitStrategy
