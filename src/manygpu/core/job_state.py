"""The job's state a checkpoint carries besides the loop's own: one object, ``par.job_state``.

A ``Checkpointer`` asks this object, and nothing else on ``Parallel``, what to
save (:meth:`JobState.parts`: model, optimizer, scaler, format, seed...), what
the tracked run needs to continue (:meth:`JobState.tracking`), and tells it
the loop's step after each step (:meth:`JobState.note_step`) and the step and
run it resumed (:meth:`JobState.restore`). New job-level state that a
checkpoint must carry (a token count, a data position...) joins here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manygpu.core.optimizer import PreparedOptimizer
from manygpu.core.steps import StepEvents
from manygpu.observe.job_log import JobLog

if TYPE_CHECKING:
    from manygpu.checkpoint_io.formats import Parts


class JobState:
    """What to save and restore of the job (the ``Checkpointer``'s one question)."""

    def __init__(
        self,
        *,
        events: StepEvents,
        log: JobLog,
        parts: Callable[[nn.Module, torch.optim.Optimizer | None], Parts],
    ) -> None:
        """``parts``: the prepared model's and optimizer's checkpoint parts, as the
        strategy, the precision and the config decide them (built by ``Parallel``)."""
        self._events, self._log, self._parts = events, log, parts

    def parts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Parts:
        """What a checkpoint of the prepared ``model`` and ``optimizer`` saves and loads."""
        inner = optimizer.optimizer if isinstance(optimizer, PreparedOptimizer) else optimizer
        return self._parts(model, inner)

    def tracking(self) -> dict[str, Any] | None:
        """The tracked run (id, last step) to store; ``None`` when the job does not log."""
        return self._log.tracking_state()

    @property
    def step(self) -> int:
        """Optimizer steps the job has done (a resume's step included)."""
        return self._events.done

    def note_step(self, step: int) -> None:
        """The loop finished its step ``step`` (``Checkpointer.after_step``): ``par.log``
        with ``step=None`` follows the loop's steps from now on."""
        self._events.note(step)

    def restore(self, step: int | None, tracking: Mapping[str, Any] | None) -> None:
        """A checkpoint of training step ``step`` was loaded (``None``: a run stored outside
        a checkpoint): the step count and the tracked run continue from it."""
        if step is not None:
            self._events.resume(step)
        self._log.resume(tracking, step=step)
