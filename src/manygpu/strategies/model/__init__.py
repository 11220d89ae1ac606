"""``ModelParallel(stages=N)`` (``"model"``): one process, a model's layers over several devices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from manygpu.checkpoint_io.formats import FULL
from manygpu.errors import UsageError
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy


@register
@dataclass(frozen=True, kw_only=True)
class ModelParallel(StrategySpec):
    """Split an ``nn.Sequential`` over this process's devices (2 CPU stages without GPUs)."""

    name: ClassVar[str] = "model"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=5, changes_loop=True, checkpoint=FULL,
        memory=MemoryModel(weights="ways", grads="ways", optimizer="ways", activations="ways"),
        comm=CommModel(replica="one_process", grads="none"), one_process=True,
        plan_ways="local_devices", ways_option="stages", mesh_axes=("dp",),
    )  # fmt: skip

    stages: int | None = None
    """Devices to split the layers over (``None``: all of this process's GPUs, or 2)."""

    def __post_init__(self) -> None:
        n = self.stages
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UsageError(f"ModelParallel(stages=...) takes an integer >= 1, not {n!r}")

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.model.strategy import ModelParallelStrategy

        return ModelParallelStrategy
