"""What a user picks: a strategy object that carries its own options.

``Parallel(strategy=FSDP(param_dtype="bf16"))``, ``DDP(bucket_cap_mb=50)``,
``PS(servers=2, mode="async")``: each strategy's package defines its object,
with its card (what the planner knows of it) as data on the class, and
registers it (:func:`~.registry.register`). The class that does the work, and
the torch machinery behind it (FSDP2, DTensor, pipelining), is imported only by
:meth:`StrategySpec.implementation`, when a job uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from manygpu.runtime.env import Environ
    from manygpu.strategies.base import Strategy
    from manygpu.strategies.registry import StrategyCard


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """A strategy as the user picks it: its registry name, its card, its options."""

    name: ClassVar[str]
    """Registry name, e.g. ``"fsdp"``: ``strategy="fsdp"`` is ``FSDP()``."""
    card: ClassVar[StrategyCard]
    """What the planner knows of this strategy: costs, loop, checkpoint format."""

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        """The class that does the work, imported now."""
        raise NotImplementedError(f"{cls.__name__} names no implementation")

    def launched(self, environ: Environ) -> StrategySpec:
        """These options with what the launcher decided for them (default: as they are)."""
        return self

    @classmethod
    def from_name(cls) -> StrategySpec:
        """The object a bare name stands for (``strategy="fsdp"`` is ``FSDP()``): the
        defaults; a strategy that cannot run without arguments refuses here, in one line."""
        return cls()
