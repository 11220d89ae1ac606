"""Checkpoints: atomic saves, exact resume, resharding, export (imported on use)."""

from typing import TYPE_CHECKING

from manygpu import _lazy

if TYPE_CHECKING:
    from manygpu.checkpoint.manager import Checkpointer, TrainState
    from manygpu.errors import CheckpointError

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "CheckpointError": "manygpu.errors",
        "Checkpointer": "manygpu.checkpoint.manager",
        "TrainState": "manygpu.checkpoint.manager",
    },
)

__all__ = ["CheckpointError", "Checkpointer", "TrainState"]
