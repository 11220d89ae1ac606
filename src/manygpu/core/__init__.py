"""The one object users hold: :class:`Parallel`, with its configuration (imported on use)."""

from typing import TYPE_CHECKING

from manygpu import _lazy

if TYPE_CHECKING:
    from manygpu.core.config import ParallelConfig
    from manygpu.core.parallel import Parallel

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "Parallel": "manygpu.core.parallel",
        "ParallelConfig": "manygpu.core.config",
    },
)

__all__ = [
    "Parallel",
    "ParallelConfig",
]
