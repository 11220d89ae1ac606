"""Where a profiled window's time went on each rank: compute, communication, input.

Pure functions over the spans torch's profiler records (name, start, end in
microseconds), so the arithmetic is tested with plain data. A step is a
``ProfilerStep#N`` span (torch marks one per ``profiler.step()``); the window's
time is their union. Communication is the union of the collectives' spans —
gloo's run on its worker threads from enqueue to completion, NCCL's are GPU
kernels — so a rank that reaches the all-reduce early and waits there for a
slow peer shows that wait as communication. Input is the time inside the
DataLoader's ``__next__`` (torch marks it too); compute is what is left. The
main rank compares the ranks (:class:`ProfileSummary`), naming the slowest per
phase and its host.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

COLLECTIVE_PREFIXES = (
    "gloo:",
    "nccl:",
    "mpi:",
    "ucc:",
    "c10d::",
    "nccldevkernel",
    "ncclkernel",
    "record_param_comms",
)
"""Lower-cased name prefixes of communication spans: the backends' own work
(``gloo:all_reduce``), the dispatcher's ops (``c10d::allreduce_``), NCCL's kernels."""
INPUT_PREFIX = "enumerate(DataLoader)#"
"""How torch names a DataLoader iterator's ``__next__``: time spent waiting for input."""
STEP_PREFIX = "ProfilerStep"
"""torch's span around each ``profiler.step()`` (``ProfilerStep#12``; ``ProfilerStep*`` in
``profile.events()``)."""

Interval = tuple[float, float]


@dataclass(frozen=True)
class Span:
    """One recorded event: its name and when it ran (microseconds, any common origin)."""

    name: str
    start_us: float
    end_us: float


@dataclass(frozen=True)
class RankTimes:
    """One rank's window, as milliseconds per step."""

    rank: int
    host: str
    steps: int
    step_ms: float
    compute_ms: float
    comm_ms: float
    """Time some collective was in flight (waiting for a peer included)."""
    input_ms: float | None
    """Time in the DataLoader; ``None`` when the window read no DataLoader."""

    def to_json(self) -> dict[str, Any]:
        """Plain data for :func:`~manygpu.comm.objects.all_gather_json` (never pickle)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankTimes:
        """Read back what another rank sent; a ``TypeError``/``KeyError`` when it is not ours."""
        if not isinstance(data, Mapping) or set(data) != set(cls.__dataclass_fields__):
            raise TypeError(f"expected the fields {sorted(cls.__dataclass_fields__)}")
        if not isinstance(data["host"], str) or not all(
            isinstance(data[k], int) and not isinstance(data[k], bool) for k in ("rank", "steps")
        ):
            raise TypeError("rank and steps must be integers, host a string")
        numbers = ["step_ms", "compute_ms", "comm_ms"]
        numbers += [] if data["input_ms"] is None else ["input_ms"]
        if not all(isinstance(data[k], int | float) for k in numbers):
            raise TypeError("times must be numbers")
        return cls(**data)


def is_collective(name: str) -> bool:
    """Whether a span named ``name`` is communication."""
    return name.lower().startswith(COLLECTIVE_PREFIXES)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The disjoint, sorted intervals covering the same time as ``intervals``."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Total time that two disjoint sorted interval lists share."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def split(spans: Iterable[Span], *, rank: int, host: str) -> RankTimes:
    """This rank's window from its recorded spans.

    Only time inside the steps counts: a collective still in flight when the
    window ended is cut at its edge. Input overlapped by communication counts
    once, as communication.
    """
    steps, comms, inputs = [], [], []
    for span in spans:
        interval = (span.start_us, span.end_us)
        if span.name.startswith(STEP_PREFIX):
            steps.append(interval)
        elif is_collective(span.name):
            comms.append(interval)
        elif span.name.startswith(INPUT_PREFIX):
            inputs.append(interval)
    window = union(steps)
    wall = sum(end - start for start, end in window)
    comm = overlap(union(comms), window)
    both = overlap(union(comms + inputs), window)
    per = 1e3 * max(1, len(steps))  # microseconds in a window -> ms per step
    return RankTimes(
        rank=rank,
        host=host,
        steps=len(steps),
        step_ms=round(wall / per, 3),
        compute_ms=round(max(0.0, wall - both) / per, 3),
        comm_ms=round(comm / per, 3),
        input_ms=round((both - comm) / per, 3) if inputs else None,
    )


PHASES = ("compute", "comm", "input")


@dataclass(frozen=True)
class ProfileSummary:
    """Every rank's window, in rank order, and which rank was slowest in each phase."""

    first: int
    stop: int
    ranks: tuple[RankTimes, ...]
    directory: str

    def slowest(self, phase: str) -> RankTimes | None:
        """The rank with the most time per step in ``phase`` (``None``: nobody measured it)."""
        known = [r for r in self.ranks if _phase_ms(r, phase) is not None]
        return max(known, key=lambda r: _phase_ms(r, phase) or 0.0) if known else None

    def lines(self) -> list[str]:
        """The summary as the main rank prints it."""
        head = (
            f"manygpu: profile of steps {self.first}..{self.stop - 1} on {len(self.ranks)} "
            f"rank(s), ms per step; traces in {self.directory}"
        )
        rows = [
            f"  rank {r.rank} ({r.host}): step {r.step_ms:.1f}  compute {r.compute_ms:.1f}  "
            f"comm {r.comm_ms:.1f}  input {_text(r.input_ms)}"
            for r in self.ranks
        ]
        worst = []
        for phase in PHASES:
            rank = self.slowest(phase)
            if rank is not None:
                worst.append(
                    f"{phase}: rank {rank.rank} ({rank.host}) {_phase_ms(rank, phase):.1f} ms"
                )
        return [head, *rows, "  slowest per phase: " + "; ".join(worst)]


def _phase_ms(rank: RankTimes, phase: str) -> float | None:
    value: float | None = getattr(rank, f"{phase}_ms")
    return value


def _text(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
