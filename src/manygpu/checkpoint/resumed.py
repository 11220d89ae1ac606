"""What a resume tells the person who started the run: one line, from the main rank.

A resume that prints nothing leaves them guessing whether it happened, and
from where; a world-size change used to be one Python warning per rank. Now
the main rank prints, once::

    resumed ckpts/step-00000060: step 60, epoch 2, sample 480; world size 2 -> 3

``sample`` is where the data loader picks up inside its epoch (global
samples already read); the world-size part appears only when it changed.
The arithmetic of that position is here too, as a pure function, so the
line and the loader can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from manygpu.checkpoint_io.remote import Url


@dataclass(frozen=True, kw_only=True)
class Position:
    """Where a loader resumes inside its epoch."""

    epoch: int
    """The epoch it is in."""
    batches: int
    """Batches of that epoch each rank skips (already trained on)."""
    sample: int
    """Global samples of the epoch those batches hold: where reading picks up."""
    early: int
    """Samples read again: the saved position did not split into whole global
    batches of the new world size and batch size (0 when it did)."""


def position(saved: Mapping[str, int], *, world: int, batch: int) -> Position:
    """The position a checkpoint's loader entry maps to on ``world`` ranks of ``batch``.

    The same number of global samples stays consumed, spread over the new
    ranks; what does not make a whole global batch is read again.
    """
    done = int(saved["batches"]) * int(saved["world"]) * int(saved["batch_size"])
    per_step = world * batch
    batches = done // per_step
    return Position(
        epoch=int(saved["epoch"]),
        batches=batches,
        sample=batches * per_step,
        early=done - batches * per_step,
    )


@dataclass(frozen=True, kw_only=True)
class Resumed:
    """A resume that worked: what was loaded, and onto how many ranks."""

    path: Path | Url
    """The checkpoint directory loaded."""
    step: int
    """Its step."""
    epoch: int
    """The epoch training goes on in."""
    saved_world: int
    """The world size that saved it."""
    world: int
    """This run's world size."""
    where: Position | None = None
    """The loader's position, when the checkpoint and the run both have a loader."""

    def line(self) -> str:
        """The one line a resume prints."""
        text = f"resumed {self.path}: step {self.step}, epoch {self.epoch}"
        if self.where is not None:
            text += f", sample {self.where.sample}"
        if self.saved_world != self.world:
            text += f"; world size {self.saved_world} -> {self.world}"
        if self.where is not None and self.where.early:
            text += (
                f"; {self.where.early} samples of this epoch are read again "
                "(what was read does not split into whole global batches now)"
            )
        return text
