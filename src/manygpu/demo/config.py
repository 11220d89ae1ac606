"""What ``manygpu demo`` trains, as its command hands it to every worker."""

from __future__ import annotations

import math
from dataclasses import dataclass

from manygpu.core.config import PRECISIONS
from manygpu.errors import UsageError
from manygpu.strategies import spec_class
from manygpu.tracking.registry import check_names

MIN_IMAGE_SIZE = 6
"""Two 3x3 convolutions and a 2x2 pool need at least this many pixels a side."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """The demo's training run: checked here, once, by the command that launches it."""

    epochs: int = 6
    """Passes over the training digits."""
    global_batch_size: int = 64
    """Samples per step over all workers together (checked against the world at launch)."""
    lr: float = 2e-3
    """Adam's learning rate."""
    strategy: str = "ddp"
    """A registered strategy's name."""
    precision: str = "fp32"
    """One of ``fp32``, ``bf16``, ``fp16`` (autocast, as in :class:`~manygpu.Parallel`)."""
    image_size: int = 16
    """Side of the digit images in pixels (scikit-learn's 8x8, interpolated)."""
    json_path: str | None = None
    """Also write the results here as JSON."""
    log_with: tuple[str, ...] = ()
    """Trackers every training step is logged to (``Parallel(log_with=...)``); none: no logging."""
    run_dir: str | None = None
    """Where the trackers write (``Parallel(run_dir=...)``); ``None``: ``runs``."""

    def __post_init__(self) -> None:
        # The order of the checks is the order the command always reported them in.
        if self.precision not in PRECISIONS:
            raise UsageError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        if self.epochs < 1:
            raise UsageError(f"--epochs must be at least 1, got {self.epochs}")
        spec_class(self.strategy)  # an unknown name: one line listing the known ones
        if not 0 < self.lr < math.inf:
            raise UsageError(f"--lr must be a number > 0, got {self.lr}")
        if self.image_size < MIN_IMAGE_SIZE:
            raise UsageError(
                f"image size must be at least {MIN_IMAGE_SIZE} pixels, got {self.image_size}"
            )
        check_names(self.log_with)  # an unknown tracker: one line naming the known ones
