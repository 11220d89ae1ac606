"""``PS(servers=2, mode="async")`` (``"ps"``): parameter servers (TensorFlow's kind).

The job's first ``servers`` ranks hold the parameters and the optimizer state,
split by size; the others are workers that run the loop, push gradients and
pull parameters at each ``step()`` (see :mod:`.strategy`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from manygpu.checkpoint_io.formats import FULL
from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.runtime.env import Environ
    from manygpu.strategies.base import Strategy

PSMode = Literal["sync", "async"]


@register
@dataclass(frozen=True, kw_only=True)
class PS(StrategySpec):
    """Servers hold the parameters and optimizer state; workers push and pull."""

    name: ClassVar[str] = "ps"
    # The loop is unchanged, but the job's first ranks serve instead of training,
    # so "auto" never picks it; workers keep whole weights and gradients, the
    # servers the optimizer state (split over `ways` of them: an upper bound for
    # either role). Gradients go whole to the servers after the backward and the
    # weights come back: exposed, not overlapped.
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=9, changes_loop=True, checkpoint=FULL, memory=MemoryModel(optimizer="ways"),
        comm=CommModel(grads="push_pull"), one_process=False, plan_ways="servers", serves=True,
        ways_option="servers",
    )  # fmt: skip

    servers: int | None = None
    """How many of the job's ranks serve (the first ones). ``None``: the ``K``
    of ``manygpu launch --ps K``, else 1."""
    mode: PSMode = "sync"
    """``"sync"``: each step averages every worker's gradient before one update
    (the same result as one process on the global batch, like ddp).
    ``"async"``: each gradient is applied as it arrives; workers never wait
    for each other (within ``max_staleness``) and a dead worker is dropped."""
    max_staleness: int | None = None
    """``"async"`` only: how many steps a worker may run ahead of the slowest
    live worker, i.e. how many of that worker's updates its parameters may
    lack; it waits beyond that (bounded delay). ``0`` lets no worker start a
    step before every other finished the previous one; ``None``: unbounded."""

    def __post_init__(self) -> None:
        servers = self.servers
        if servers is not None and (
            isinstance(servers, bool) or not isinstance(servers, int) or servers < 1
        ):
            raise UsageError(f"PS(servers=...) takes an integer >= 1, not {servers!r}")
        if self.mode not in ("sync", "async"):
            raise UsageError(f"unknown parameter-server mode {self.mode!r}; choose sync or async")
        s = self.max_staleness
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise UsageError(f"PS(max_staleness=...) takes an integer >= 0 or None, not {s!r}")
        if s is not None and self.mode == "sync":
            raise UsageError(
                "max_staleness bounds the lag of mode='async'; a sync step has none: "
                "drop max_staleness or use mode='async'"
            )

    def launched(self, environ: Environ) -> PS:
        """These options with ``servers`` decided: the launcher's ``--ps K`` must agree."""
        launched = envmod.launched_servers(environ)
        if launched is not None and self.servers is not None and launched != self.servers:
            raise UsageError(
                f"the script asks for PS(servers={self.servers}) but was launched with "
                f"--ps {launched}; make them agree, or give only one"
            )
        servers = self.servers if self.servers is not None else launched or 1
        return replace(self, servers=servers)

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.ps.strategy import ParameterServerStrategy

        return ParameterServerStrategy
