"""``Parallelize(fn)`` (``"parallelize"``): the user's own plan on manygpu's job.

``fn(model, mesh)`` applies whatever the user's recipe does (DTensor tensor
parallel, FSDP2 ``fully_shard``, float8, ``compile``) to the model on this
rank's device, over the job's ``DeviceMesh`` (``mesh={"dp": 2, "tp": 4}``;
default: every rank on ``fsdp``), as torchtitan's ``parallelize_*`` functions
and Lightning Fabric's ``ModelParallelStrategy`` take them. manygpu brings the
launcher, the mesh, the data split over the mesh's data dimensions, DCP
checkpoints, clipping by the whole model's norm and the diagnostics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from manygpu.checkpoint_io.formats import DCP
from manygpu.errors import UsageError
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy


@register
@dataclass(frozen=True)
class Parallelize(StrategySpec):
    """The user's ``fn(model, mesh)`` applied over the job's mesh."""

    name: ClassVar[str] = "parallelize"
    # What it costs is the user's plan's: the planner never proposes it.
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=10, changes_loop=True, checkpoint=DCP, memory=MemoryModel(),
        comm=CommModel(grads="all_reduce"), one_process=False, plan_ways="never",
        mesh_axes="all", mesh_default="fsdp",
    )  # fmt: skip

    fn: Callable[[Any, Any], Any]
    """``fn(model, mesh)``: parallelizes ``model`` in place over ``mesh``, a torch
    ``DeviceMesh`` with the job's named dimensions; may return the model to use
    instead. ``model`` is as built: on the CPU, or on the meta device under
    ``par.init_module()`` (``fully_shard`` and ``parallelize_module`` move or
    shard it per part); what this rank keeps is allocated on its device after."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise UsageError(
                "Parallelize needs your plan: Parallelize(fn), where fn(model, mesh) "
                f"applies it; got {self.fn!r}"
            )

    @classmethod
    def from_name(cls) -> Parallelize:
        raise UsageError(
            "strategy='parallelize' needs your plan: give strategy=Parallelize(fn), "
            "where fn(model, mesh) applies it"
        )

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.parallelize.strategy import ParallelizeStrategy

        return ParallelizeStrategy
