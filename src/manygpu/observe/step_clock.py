"""Each rank's training step, split into waiting for input, computing, and waiting for the others.

Under DDP every rank's step lasts as long as the slowest rank's (the gradient
all-reduce waits for it), so the step time alone names nobody. What differs is
how the step is spent: the slow rank computes longer and waits less for the
others. The clock measures on the training thread only what it sees for free —
the step (one optimizer step to the next), the time spent inside the prepared
loader — and asks the strategy for the exposed communication of a sampled step
(DDP's reducer times its own all-reduce; see
:meth:`manygpu.strategies.Strategy.comm_probe`). Compute is what is left.

Every ``every`` steps the window's medians (robust to the one step that saved a
checkpoint or ran an evaluation) are handed to a sink, which ships them to the
main rank off the training thread (:mod:`manygpu.observe.straggler_board`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from manygpu.strategies.abilities import CommProbe

DEFAULT_EVERY = 50
"""Steps per report: the clock's cost is a few timer reads a step, the report's
(one queue put, read off the thread) is paid once per window; see BENCHMARKS.md."""


@dataclass(frozen=True)
class StepSplit:
    """One rank's window of steps, as medians in milliseconds."""

    rank: int
    host: str
    window: int
    steps: int
    step_ms: float
    input_ms: float
    compute_ms: float
    comm_ms: float | None
    """Exposed communication; ``None`` where the strategy cannot tell it apart from compute."""
    peers: int = 0
    """Ranks compare only with ranks of the same label (a pipeline's stage)."""
    link_ms: float | None = None
    """This host's round trip of a fixed payload to the job's store (one rank per host)."""


class StepClock:
    """Times this rank's steps and hands every window's split to ``sink``."""

    def __init__(
        self, every: int, rank: int, host: str, peers: int, sink: Callable[[StepSplit], None]
    ) -> None:
        self.every, self.rank, self.host, self.peers = every, rank, host, peers
        self._sink = sink
        self._probe: CommProbe | None = None
        self._probe_every = max(1, every // 10)  # about ten samples per window
        self._last: float | None = None
        self._input = 0.0
        self._walls: list[float] = []
        self._inputs: list[float] = []
        self._comms: list[float] = []
        self._computes: list[float] = []  # per sampled step: its busy time - its exposed comm
        # (start ns, end ns, busy s) of the last steps, for pairing samples with them
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=2 * self._probe_every + 2)
        self._last_ns = 0
        self._steps = 0
        self._window = 0

    def attach(self, probe: CommProbe | None) -> None:
        """Use ``probe`` (the first prepared model's) for exposed communication."""
        if self._probe is None:
            self._probe = probe

    @property
    def probe_every(self) -> int:
        """Steps between samples of the probe (strategies sample their timers at this rate)."""
        return self._probe_every

    def waited_for_input(self, seconds: float) -> None:
        """Time the training loop spent in the prepared loader for the current step."""
        self._input += seconds

    def exclude(self, seconds: float) -> None:
        """``seconds`` since the last step were not training (a profile window writing its
        trace after it): the next step's time starts that much later."""
        if self._last is not None:
            self._last += seconds
            self._last_ns += int(seconds * 1e9)

    def step(self) -> None:
        """One optimizer step is done (called on sync steps only)."""
        now, now_ns = time.perf_counter(), time.time_ns()
        if self._last is not None:
            wall = now - self._last
            self._walls.append(wall)
            self._inputs.append(self._input)
            self._recent.append((self._last_ns, now_ns, max(0.0, wall - self._input)))
        self._last, self._last_ns, self._input = now, now_ns, 0.0
        self._steps += 1
        if self._probe is not None and self._steps % self._probe_every == 0:
            self._sample(self._probe)
        if len(self._walls) >= self.every:
            self._sink(self._flush())

    def _sample(self, probe: CommProbe) -> None:
        """Take the probe's new sample, paired with the step it belongs to.

        Compute is that step's own busy time minus that step's exposed
        communication: the two move together (a peer descheduled for a moment
        lengthens both), so their difference is far steadier than the
        difference of two medians.
        """
        sample = probe()
        if sample is None:
            return
        started_ns, exposed = sample
        self._comms.append(exposed)
        for began_ns, ended_ns, busy in self._recent:
            if began_ns <= started_ns < ended_ns:
                self._computes.append(max(0.0, busy - exposed))
                return

    def _flush(self) -> StepSplit:
        comm = statistics.median(self._comms) if self._comms else None
        busy = statistics.median(
            max(0.0, w - i) for w, i in zip(self._walls, self._inputs, strict=True)
        )
        compute = (
            statistics.median(self._computes) if self._computes else max(0.0, busy - (comm or 0.0))
        )
        split = StepSplit(
            rank=self.rank,
            host=self.host,
            window=self._window,
            steps=len(self._walls),
            step_ms=_ms(statistics.median(self._walls)),
            input_ms=_ms(statistics.median(self._inputs)),
            compute_ms=_ms(compute),
            comm_ms=None if comm is None else _ms(comm),
            peers=self.peers,
        )
        self._window += 1
        self._walls, self._inputs, self._comms, self._computes = [], [], [], []
        return split


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
