"""``Single()`` (``"single"``): one process, one device; the reference every strategy matches."""

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
class Single(StrategySpec):
    """Plain training on this process's device."""

    name: ClassVar[str] = "single"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=0, changes_loop=False, checkpoint=FULL, memory=MemoryModel(),
        comm=CommModel(replica="one_process", grads="none"), one_process=True, plan_ways="one",
    )  # fmt: skip

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.single.strategy import SingleDevice

        return SingleDevice
