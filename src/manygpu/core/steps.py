"""The job's step event: one counter of optimizer steps and one ordered list of listeners.

Everything that happens "at every optimizer step" hangs here, not on the
optimizer's own hooks or on wrappers of each other's callbacks: the straggler
clock's tick, the profiler's window, fp8's scale precompute, and (later) what
the token-weighted loss rescales before the update. The prepared optimizer
owns the event and fires it; listeners run in a fixed order (:data:`ORDER`),
whatever order the features were set up in, so one feature's timing never
depends on which line of ``prepare`` came first.

The count is the *job's* step: it starts at a resumed checkpoint's step
(:meth:`StepEvents.resume`), and a ``Checkpointer`` notes the loop's own
``TrainState.step`` (:meth:`StepEvents.note`), so ``par.log(step=None)`` and
``par.profile`` number steps alike before and after a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Listener = Callable[[int], None]
"""Called with the job's step number just completed (1 for the first step)."""

ORDER: tuple[str, ...] = ("fp8", "clock", "profiler", "data")
"""Listeners after the update, in the order they run: fp8's scales first (the next
forward needs them, and their all-reduce belongs to the step's time), then the
straggler clock closes the step, then the profiler's window (whose trace write
must not land in the step the clock measured), then the first step's check that
a loader was prepared."""

BEFORE_ORDER: tuple[str, ...] = ("grad_rescale",)
"""Listeners before the update (gradients final, nothing applied yet)."""


@dataclass
class _Entry:
    name: str
    listener: Listener
    every_optimizer: bool


class StepEvents:
    """The job's optimizer-step counter and the listeners of each step."""

    def __init__(self) -> None:
        self.done = 0
        """Training steps done: the first prepared optimizer's updates, from a resume's step."""
        self.noted: int | None = None
        """The loop's own step, as a ``Checkpointer`` last saw it (``None``: never)."""
        self._after: list[_Entry] = []
        self._before: list[_Entry] = []

    def on_step(self, name: str, listener: Listener, *, every_optimizer: bool = False) -> None:
        """Run ``listener`` after each training step (``every_optimizer``: after every
        prepared optimizer's update, e.g. fp8 scales a second optimizer also changed)."""
        self._add(self._after, ORDER, _Entry(name, listener, every_optimizer))

    def before_step(self, name: str, listener: Listener) -> None:
        """Run ``listener`` before each training step's update (gradients final)."""
        self._add(self._before, BEFORE_ORDER, _Entry(name, listener, False))

    def stepping(self, first: bool) -> None:
        """A prepared optimizer is about to apply an update (``first``: the job's first one)."""
        if first:
            for entry in self._before:
                entry.listener(self.done + 1)

    def stepped(self, first: bool) -> None:
        """A prepared optimizer applied an update; the first optimizer's count the job's steps."""
        if first:
            self.done += 1
        for entry in self._after:
            if first or entry.every_optimizer:
                entry.listener(self.done)

    def resume(self, step: int) -> None:
        """A checkpoint of training step ``step`` was loaded: the count continues from it."""
        self.done = max(self.done, step)
        self.note(step)

    def note(self, step: int) -> None:
        """The loop's own step counter (a ``Checkpointer``'s ``TrainState.step``)."""
        self.noted = step

    @property
    def job_step(self) -> int | None:
        """The job's step once the loop's own counter is known (``None`` before): the
        loop's ``TrainState.step`` or the optimizer steps, whichever is ahead."""
        return None if self.noted is None else max(self.noted, self.done)

    @staticmethod
    def _add(entries: list[_Entry], order: tuple[str, ...], entry: _Entry) -> None:
        if entry.name not in order:
            raise ValueError(f"step listener {entry.name!r} has no place in {order}")
        if any(e.name == entry.name for e in entries):
            raise ValueError(f"step listener {entry.name!r} is already registered")
        entries.append(entry)
        entries.sort(key=lambda e: order.index(e.name))
