"""The demo's speed-up as a median over timing windows, with its spread and the machine's load.

One stretch of N workers followed by one stretch of one worker gave 1.49x, and
1.04x three minutes later, on the same machine: whatever else ran there landed
on one side of the comparison only. So the demo pairs them: each window times
the N workers for one epoch and then one worker alone on the same number of
steps straight after, a burst of load hits both sides of the same window, and
the median over windows sets aside the window a burst hit hardest. The spread
(lowest to highest window) says how far to trust the median, and the load
average says why it may be wide. Pure functions; the timing is in ``train.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

NOISY = 0.25
"""Windows whose speed-ups differ by more than this fraction of the median are called noisy."""


@dataclass(frozen=True)
class Window:
    """One timing window: the job's throughput, then one worker's on the same steps."""

    workers_samples_per_s: float
    """All workers together, over one epoch."""
    single_samples_per_s: float | None = None
    """One worker alone right after; ``None`` when the job has one worker."""

    @property
    def speedup(self) -> float | None:
        if not self.single_samples_per_s:
            return None
        return self.workers_samples_per_s / self.single_samples_per_s


@dataclass(frozen=True)
class Spread:
    """The median of some windows' values and the range they span."""

    median: float
    low: float
    high: float
    windows: int

    @property
    def relative(self) -> float:
        """(highest - lowest) / median: 0 when every window agrees."""
        return (self.high - self.low) / self.median if self.median else 0.0

    @property
    def noisy(self) -> bool:
        return self.relative > NOISY


@dataclass(frozen=True)
class Load:
    """The 1-minute load average when the demo's training began and ended, and the CPUs."""

    start: float
    end: float
    cpus: int


def spread(values: Sequence[float]) -> Spread | None:
    """Median, lowest and highest of ``values``; ``None`` for none."""
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


def speedup_spread(windows: Sequence[Window]) -> Spread | None:
    """The spread of the windows' speed-ups; ``None`` when no window compared with one worker."""
    return spread([s for w in windows if (s := w.speedup) is not None])


def machine_load() -> tuple[float, int]:
    """(1-minute load average, logical CPUs) of this machine, through psutil."""
    import psutil

    return float(psutil.getloadavg()[0]), psutil.cpu_count() or 1


def busy(load: Load, own_workers: int) -> bool:
    """Whether something besides the demo competed for the CPUs.

    At the start the 1-minute average hardly counts the demo's own workers yet;
    at the end it does, so they are taken off before comparing with the CPUs.
    """
    others = max(load.start, load.end - own_workers)
    return others >= load.cpus / 2


def speedup_text(s: Spread) -> str:
    """``speed-up 1.42x (median of 5 windows, 1.31x-1.55x)``."""
    if s.windows == 1:
        return f"speed-up {s.median:.2f}x (one timing window; more --epochs give a median)"
    return f"speed-up {s.median:.2f}x (median of {s.windows} windows, {s.low:.2f}x-{s.high:.2f}x)"


def load_text(load: Load, own_workers: int, s: Spread | None) -> str:
    """The machine's load, and a warning when it or the windows' spread make the number shaky."""
    line = f"load average {load.start:.1f} at the start, {load.end:.1f} at the end"
    line += f", on {load.cpus} CPUs"
    if busy(load, own_workers):
        return f"{line}: other work shared the CPUs, so the speed-up is noisy; rerun when idle"
    if s is not None and s.noisy:
        return f"{line}: the windows disagree by {s.relative:.0%}, so the speed-up is noisy"
    return line
