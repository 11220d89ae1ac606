"""What a user picks: a strategy object that carries its own options.

``Parallel(strategy=FSDP(param_dtype="bf16"))``, ``DDP(bucket_cap_mb=50)``,
``PS(servers=2, mode="async")``: each strategy's package defines its object,
with its card (what the planner knows of it) as data on the class, and
registers it (:func:`~.registry.register`). The class that does the work, and
the torch machinery behind it (FSDP2, DTensor, pipelining), is imported only by
:meth:`StrategySpec.implementation`, when a job uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from manygpu.errors import UsageError

if TYPE_CHECKING:
    from manygpu.runtime.env import Environ
    from manygpu.strategies.base import Strategy
    from manygpu.strategies.registry import StrategyCard

S = TypeVar("S", bound="StrategySpec")


@dataclass(frozen=True, kw_only=True)
class Legacy:
    """The per-strategy keywords ``Parallel`` took before strategies carried their options
    (``ddp=DDPOptions(...)``, ``fsdp=``, ``model_stages=``, ``pipeline=``, ``tensor=``,
    ``ps=``): deprecated, kept for one release. Each strategy reads the ones it used."""

    ddp: Any = None
    fsdp: Any = None
    model_stages: int | None = None
    pipeline: Any = None
    tensor: Any = None
    ps: Any = None

    def given(self) -> list[str]:
        """The keywords given, by name."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


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
    def from_legacy(cls, legacy: Legacy) -> StrategySpec:
        """This strategy's object from the deprecated keywords (default: its defaults)."""
        return cls()


def copy_fields(cls: type[S], source: object, keyword: str, **extra: Any) -> S:
    """``cls`` built from the same-named fields of ``source``, what the deprecated
    ``keyword=`` gave; anything but an object of ``cls``'s own kind is refused."""
    kind = next(c for c in cls.__mro__ if c.__base__ is StrategySpec)
    if not isinstance(source, kind):
        raise UsageError(
            f"{keyword}= takes {kind.__name__}(...), not {source!r}; better: "
            f"strategy={cls.__name__}(...)"
        )
    names = {f.name for f in fields(cls)} - set(extra)
    given = {f.name: getattr(source, f.name) for f in fields(source) if f.name in names}  # type: ignore[arg-type]
    return cls(**given, **extra)
