"""The pipeline schedules torch 2.13 provides, what each needs, and its bubble.

A schedule with *virtual stages* cuts the model into ``pp x v`` stages and
gives each rank ``v`` of them: looped (rank ``r`` holds stages ``r, r + pp,
...``; interleaved 1F1B and interleaved zero bubble) or in a V (rank ``r``
holds ``r`` and ``2 pp - 1 - r``, so rank 0 holds both the first and the last
stage; ZBV and DualPipeV, exactly two per rank). Zero-bubble schedules split
each backward into the input-gradient part (on the critical path) and the
weight-gradient part (deferred into what would be idle time).

Imports nothing from torch: the spec validates names before any group exists,
and the planner estimates bubbles without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Style = Literal["loop", "v"]


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule: torch's class, how stages sit on ranks, and what it needs."""

    torch_name: str
    style: Style
    virtual: int | None
    """Stages per rank it takes: ``1`` (single-stage), ``2`` (V schedules), or
    ``None`` (any number >= 2, default 2)."""
    weight_split: bool
    """Whether it defers weight gradients into the bubble (zero bubble)."""

    @property
    def multi(self) -> bool:
        return self.virtual != 1


SCHEDULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo("ScheduleGPipe", "loop", 1, False),
    "1f1b": ScheduleInfo("Schedule1F1B", "loop", 1, False),
    "interleaved-1f1b": ScheduleInfo("ScheduleInterleaved1F1B", "loop", None, False),
    "interleaved-zero-bubble": ScheduleInfo("ScheduleInterleavedZeroBubble", "loop", None, True),
    "zbv": ScheduleInfo("ScheduleZBVZeroBubble", "v", 2, True),
    "dualpipev": ScheduleInfo("ScheduleDualPipeV", "v", 2, True),
}


def info(schedule: str) -> ScheduleInfo:
    """The schedule called ``schedule``; an unknown name is a ``KeyError``."""
    return SCHEDULES[schedule]


def virtual_stages(schedule: str, asked: int | None) -> int:
    """Stages per rank: the schedule's fixed count, else what was asked, else 2."""
    fixed = info(schedule).virtual
    return fixed if fixed is not None else (asked or 2)


def virtual_refusal(schedule: str, asked: int | None) -> str | None:
    """Why ``virtual_stages=asked`` does not fit ``schedule``, or None."""
    fixed = info(schedule).virtual
    if asked is None:
        return None
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        return f"virtual_stages must be an integer >= 1, got {asked!r}"
    if fixed is not None and asked != fixed:
        multi = ", ".join(n for n, s in SCHEDULES.items() if s.virtual is None)
        return (
            f"schedule={schedule!r} runs {fixed} stage(s) per rank, not virtual_stages={asked}; "
            f"leave virtual_stages unset, or choose {multi} for {asked} per rank"
        )
    if fixed is None and asked < 2:
        return (
            f"schedule={schedule!r} interleaves several stages per rank: give "
            "virtual_stages >= 2, or use schedule='1f1b' for one"
        )
    return None


def stages_of_rank(rank: int, pp: int, virtual: int, style: Style) -> list[int]:
    """The global stage indices rank ``rank`` of ``pp`` holds, in order."""
    if style == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


def last_stage_rank(pp: int, style: Style) -> int:
    """The pp rank that holds the last stage (computes the loss)."""
    return 0 if style == "v" else pp - 1


def microbatch_refusal(schedule: str, pp: int, virtual: int, microbatches: int) -> str | None:
    """Why ``microbatches`` cannot run ``schedule`` on ``pp`` ranks, or None.

    torch raises these (as a ``ValueError`` on every rank, inside the schedule's
    constructor); here they are one line before any process group exists.
    """
    stages = pp * virtual
    if schedule == "1f1b" and microbatches < pp:
        return (
            f"Pipeline(schedule='1f1b') needs at least one micro-batch per stage: "
            f"microbatches={microbatches} < {pp} stages; raise microbatches or use "
            "schedule='gpipe'"
        )
    if schedule == "dualpipev" and microbatches < stages:
        return (
            f"Pipeline(schedule='dualpipev') needs at least as many micro-batches as stages: "
            f"microbatches={microbatches} < {stages} ({pp} ranks x 2); raise microbatches"
        )
    if info(schedule).style == "loop" and info(schedule).multi:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            fits = sorted({m for m in range(pp, 4 * pp + 1) if m % max(1, m // pp) == 0})[:4]
            return (
                f"Pipeline(schedule={schedule!r}) runs micro-batches in rounds of the "
                f"{pp} ranks: microbatches={microbatches} is not a multiple of its "
                f"{rounds} rounds; use e.g. {', '.join(map(str, fits))} (or any multiple of {pp})"
            )
    return None


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 0) -> float:
    """Idle time over useful compute, with equal forward / backward times per stage.

    GPipe and 1F1B: ``(P - 1) / M`` (Huang et al.; Narayanan et al.). Interleaved
    1F1B with ``v`` stages per rank: ``(P - 1) / (v M)`` (Narayanan et al. 2021,
    section 2.2). Zero bubble: the deferred weight gradients (about a third of a
    stage's forward + backward) fill the warm-up and cool-down, so a third of
    the interleaved bubble is left (Qi et al. 2024, ZB-H1); the V schedules
    (ZBV, DualPipeV) take ``v = 2``. An estimate: real stages differ in time.
    """
    if pp <= 1 or microbatches < 1:
        return 0.0
    v = virtual_stages(schedule, virtual or None)
    bubble = (pp - 1) / (v * microbatches)
    return bubble / 3 if info(schedule).weight_split else bubble
