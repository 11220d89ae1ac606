"""Who is slow and why, from every rank's window of step times (pure functions).

A rank is a straggler when its own work — input wait plus compute — is at least
``RELATIVE`` (20%) above the median of its peers', and the excess is at least
``STEP_SHARE`` (10%) of the step and ``ABSOLUTE_MS``, in ``STREAK`` consecutive
windows lasting ``STREAK_S`` (5 s) or more. Why those numbers: each window is
already a median over ``every`` steps, so one slow step (a checkpoint, a page
fault, the OS running something else) moves nothing; what remains between equal
ranks on a shared two-core VM is a few percent. A burst from another tenant of
the machine lasts a second or two: with dense reports (every 10 steps of 30 ms),
three windows alone named one of two identical ranks in 2 of 8 benchmark jobs,
hence the five seconds. The share of the step is what the others lose waiting
for it: a rank 40% slower at a tenth of the step costs the job 4%, which is
noise, not a straggler (two ranks sharing cores with a 50 ms sleeper show
exactly that). The absolute floor keeps sub-millisecond steps, where 20% is
timer noise, quiet. The cause is the larger part of the excess: input (the
loader) or compute (forward, backward, optimizer, user code).

A host is slow on the network when, while communication is a large part of
every rank's step (``COMM_SHARE``), its link to the job's store measures
``NETWORK_RATIO`` times the median of the other hosts'. That needs three hosts
or more: between two, one link cannot be told from the other.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from manygpu.observe.step_clock import StepSplit
from manygpu.runtime.ranks import ranks_text

RELATIVE = 0.20
ABSOLUTE_MS = 1.0
STEP_SHARE = 0.10
STREAK = 3
STREAK_S = 5.0
NETWORK_RATIO = 3.0
COMM_SHARE = 0.25
MIN_NETWORK_HOSTS = 3


@dataclass(frozen=True)
class Finding:
    """One suspicion in one window: ``subject`` is slow because of ``cause``."""

    subject: str  # "rank 3" or "host h2"
    cause: str  # "compute" | "input" | "network"
    who: str  # how the line names the subject: "rank 3 (host h2)"
    detail: str  # what the line says of it
    excess_ms: float = 0.0  # how much longer than its peers' median its own work takes

    @property
    def line(self) -> str:
        return f"{self.who} {self.detail}" if self.who else self.detail


def _busy(split: StepSplit) -> float:
    return split.input_ms + split.compute_ms


def _peers_median(splits: Sequence[StepSplit], me: StepSplit, value: str) -> float:
    others = [getattr(s, value) for s in splits if s.peers == me.peers and s.rank != me.rank]
    return statistics.median(others) if others else getattr(me, value)


def _fmt(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def rank_finding(splits: Sequence[StepSplit], me: StepSplit) -> Finding | None:
    """``me`` as a straggler among its peers in this window, or ``None``."""
    if not any(s.peers == me.peers and s.rank != me.rank for s in splits):
        return None
    busy = _busy(me)
    median = statistics.median(
        [_busy(s) for s in splits if s.peers == me.peers and s.rank != me.rank]
    )
    step = statistics.median([s.step_ms for s in splits if s.peers == me.peers])
    floor = max(ABSOLUTE_MS, STEP_SHARE * step)
    if busy < median * (1 + RELATIVE) or busy - median < floor:
        return None
    input_med = _peers_median(splits, me, "input_ms")
    compute_med = _peers_median(splits, me, "compute_ms")
    who = f"rank {me.rank} (host {me.host})"
    if me.input_ms - input_med >= me.compute_ms - compute_med:
        detail = (
            f"waits for input: {_fmt(me.input_ms)} per step vs {_fmt(input_med)} "
            f"(median of the others; compute {_fmt(me.compute_ms)} vs {_fmt(compute_med)})"
        )
        return Finding(f"rank {me.rank}", "input", who, detail, busy - median)
    ratio = me.compute_ms / compute_med if compute_med > 0 else float("inf")
    how = f"{ratio - 1:.0%} slower than" if ratio < 2 else f"{ratio:.1f}x as long as"
    detail = (
        f"computes {how} the median (input {_fmt(me.input_ms)}, "
        f"compute {_fmt(me.compute_ms)} vs {_fmt(compute_med)})"
    )
    return Finding(f"rank {me.rank}", "compute", who, detail, busy - median)


def network_findings(splits: Sequence[StepSplit]) -> list[Finding]:
    """Hosts whose link is much slower than the others' while the job waits on communication."""
    shares = [s.comm_ms / s.step_ms for s in splits if s.comm_ms is not None and s.step_ms > 0]
    if not shares or statistics.median(shares) < COMM_SHARE:
        return []
    links = {s.host: s.link_ms for s in splits if s.link_ms is not None}
    if len(links) < MIN_NETWORK_HOSTS:
        return []
    share = statistics.median(shares)
    found = []
    for host, link in links.items():
        others = statistics.median([v for h, v in links.items() if h != host])
        if others > 0 and link >= NETWORK_RATIO * others:
            detail = (
                f"network: exposed communication is {share:.0%} of every step, "
                f"and its link measures {link / others:.1f}x the other hosts' "
                f"({_fmt(link)} vs {_fmt(others)} per MiB round trip)"
            )
            found.append(Finding(f"host {host}", "network", f"host {host}:", detail))
    return found


def findings(splits: Sequence[StepSplit]) -> list[Finding]:
    """Every suspicion of one window, ranks of a host folded into the host when all are slow."""
    by_rank = [f for s in splits if (f := rank_finding(splits, s)) is not None]
    return _fold_hosts(splits, by_rank) + network_findings(splits)


def _fold_hosts(splits: Sequence[StepSplit], found: list[Finding]) -> list[Finding]:
    """One line for a host all of whose ranks (two or more) are slow for the same cause."""
    ranks_of: dict[str, list[int]] = {}
    for s in splits:
        ranks_of.setdefault(s.host, []).append(s.rank)
    hosts = len(ranks_of)
    out = list(found)
    for host, ranks in ranks_of.items():
        mine = [f for f in found if int(f.subject.split()[1]) in ranks]
        causes = {f.cause for f in mine}
        if hosts > 1 and len(ranks) > 1 and len(mine) == len(ranks) and len(causes) == 1:
            span = ranks_text(sorted(ranks))
            worst = max(mine, key=lambda f: f.excess_ms)
            out = [f for f in out if f not in mine]
            out.append(
                Finding(f"host {host}", causes.pop(), f"host {host} ({span}):", worst.detail)
            )
    return out


@dataclass
class Judge:
    """Says each straggler once, after ``STREAK`` windows in a row, lasting ``STREAK_S``
    seconds or more, name it for the same cause."""

    streak: int = STREAK
    streak_s: float = STREAK_S
    _runs: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    _said: set[tuple[str, str]] = field(default_factory=set)

    def window(self, splits: Sequence[StepSplit]) -> list[str]:
        """The lines newly due after this window."""
        now = {(f.subject, f.cause): f for f in findings(splits)}
        lasted = max((s.step_ms * s.steps for s in splits), default=0.0) / 1e3
        self._runs = {
            key: (self._runs.get(key, (0, 0.0))[0] + 1, self._runs.get(key, (0, 0.0))[1] + lasted)
            for key in now
        }
        due = [key for key in now if self._due(key)]
        self._said.update(due)
        return [now[key].line for key in due]

    def _due(self, key: tuple[str, str]) -> bool:
        windows, seconds = self._runs[key]
        return windows >= self.streak and seconds >= self.streak_s and key not in self._said
