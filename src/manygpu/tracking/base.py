"""What every tracker implements, and what it is told about the run it writes to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """The run a tracker opens: new (``resumed_at is None``) or continued from a checkpoint."""

    run_id: str
    """manygpu's id of the run (a W&B run id, TensorBoard's log directory name)."""
    run_dir: Path
    """Where this run's files go: ``<run_dir>/<run_id>/``."""
    config: Mapping[str, Any]
    """The job's resolved configuration, logged once, when the run is new."""
    resumed_at: int | None = None
    """The last step the checkpoint holds; ``None`` for a new run."""
    ids: Mapping[str, str] = field(default_factory=dict)
    """Ids trackers chose themselves (MLflow's run id), as the checkpoint stored them."""

    @property
    def home(self) -> Path:
        """This run's own directory (TensorBoard's log dir, the JSONL file, W&B's files)."""
        return self.run_dir / self.run_id


class Tracker(Protocol):
    """One experiment tracker, open on the main rank only.

    A resumed run may be handed steps it already holds (those logged after the
    checkpoint, before the job died): the tracker keeps the run free of
    duplicate steps in its own way: replace them with the resumed job's values
    (TensorBoard, JSONL, W&B offline) or, where it cannot, skip them (MLflow).
    """

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Write ``values`` at ``step``."""
        ...

    def run_key(self) -> str | None:
        """An id the tracker chose itself, stored in checkpoints to reopen the run."""
        ...

    def flush(self) -> None:
        """Make what was logged durable (called when a checkpoint is saved)."""
        ...

    def close(self) -> None:
        """End the run (a resume reopens it)."""
        ...
