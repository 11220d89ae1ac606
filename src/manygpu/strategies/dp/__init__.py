"""``DataParallel()`` (``"dp"``): ``nn.DataParallel``, one process driving every visible GPU.

Slower than ddp on every shape (one Python thread scatters and gathers, the
replicas are rebuilt each step): kept for the tutorials, never planned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from manygpu.checkpoint_io.formats import FULL
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy


@register
@dataclass(frozen=True, kw_only=True)
class DataParallel(StrategySpec):
    """Single-process data parallelism over all visible GPUs (``nn.DataParallel``)."""

    name: ClassVar[str] = "dp"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=8, changes_loop=False, checkpoint=FULL, memory=MemoryModel(),
        comm=CommModel(grads="all_reduce"), one_process=True, plan_ways="never",
    )  # fmt: skip

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.dp.strategy import DataParallelStrategy

        return DataParallelStrategy
