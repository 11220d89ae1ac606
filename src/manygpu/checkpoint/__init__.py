"""Checkpoints: atomic saves, exact resume, resharding, export."""

from manygpu.checkpoint.layout import CheckpointError
from manygpu.checkpoint.manager import Checkpointer, TrainState

__all__ = ["CheckpointError", "Checkpointer", "TrainState"]
