"""Straggler rules (pure): who is named slow, for which cause, and when the judge says it.

Covers :func:`rank_finding` (compute vs input stragglers, the 20% relative,
10%-of-the-step and 1 ms absolute thresholds, noise, peer labels), :func:`_fold_hosts` (a host all
of whose ranks are slow for one cause becomes one line), :func:`network_findings`
(a slow host link while communication is a large share of the step) and
:class:`Judge` (a verdict after three windows in a row lasting 5 s, said once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from manygpu.observe.step_clock import StepSplit
from manygpu.observe.straggler_rules import (
    STREAK,
    STREAK_S,
    Finding,
    Judge,
    _fold_hosts,
    findings,
    network_findings,
    rank_finding,
)


def split(
    rank: int,
    *,
    host: str | None = None,
    input_ms: float = 2.0,
    compute_ms: float = 20.0,
    comm_ms: float | None = None,
    step_ms: float | None = None,
    peers: int = 0,
    link_ms: float | None = None,
) -> StepSplit:
    """One rank's window; two ranks per host (``h0``: ranks 0-1, ``h1``: 2-3, ...) by default.

    The step defaults to the rank's own input + compute + communication.
    """
    if step_ms is None:
        step_ms = input_ms + compute_ms + (comm_ms or 0.0)
    return StepSplit(
        rank=rank,
        host=f"h{rank // 2}" if host is None else host,
        window=0,
        steps=50,
        step_ms=step_ms,
        input_ms=input_ms,
        compute_ms=compute_ms,
        comm_ms=comm_ms,
        peers=peers,
        link_ms=link_ms,
    )


def job(**slow: StepSplit) -> list[StepSplit]:
    """Four equal ranks on two hosts, with ``r<N>=split(...)`` replacing rank N."""
    return [slow.get(f"r{rank}", split(rank)) for rank in range(4)]


def named(splits: Sequence[StepSplit], rank: int) -> bool:
    return rank_finding(splits, splits[rank]) is not None


def lines(splits: Sequence[StepSplit]) -> list[str]:
    return [f.line for f in findings(splits)]


# -- ranks ---------------------------------------------------------------------------


def test_a_compute_straggler_is_named_with_its_numbers() -> None:
    splits = job(r2=split(2, compute_ms=30.0))
    found = rank_finding(splits, splits[2])
    assert found == Finding(
        "rank 2",
        "compute",
        "rank 2 (host h1)",
        "computes 50% slower than the median (input 2.0 ms, compute 30 ms vs 20 ms)",
        10.0,
    )
    assert [rank_finding(splits, s) for s in splits if s.rank != 2] == [None, None, None]
    # Rank 3 shares host h1 but is not slow: no host line, the rank's own line.
    assert lines(splits) == [
        "rank 2 (host h1) computes 50% slower than the median "
        "(input 2.0 ms, compute 30 ms vs 20 ms)"
    ]


def test_a_rank_computing_twice_as_long_is_said_as_a_ratio() -> None:
    splits = job(r0=split(0, compute_ms=50.0))
    found = rank_finding(splits, splits[0])
    assert found is not None and found.cause == "compute"
    assert found.detail.startswith("computes 2.5x as long as the median")


def test_an_input_straggler_waits_for_input() -> None:
    splits = job(r1=split(1, input_ms=12.0))
    found = rank_finding(splits, splits[1])
    assert found is not None
    assert (found.subject, found.cause) == ("rank 1", "input")
    assert found.line == (
        "rank 1 (host h0) waits for input: 12 ms per step vs 2.0 ms "
        "(median of the others; compute 20 ms vs 20 ms)"
    )


def test_uniform_noise_within_15_percent_names_nobody() -> None:
    factors = [1.15, 0.85, 1.10, 0.90, 1.05, 0.95, 1.0, 1.0]
    # Input and compute each vary by up to 15%, independently of each other.
    splits = [
        split(rank, input_ms=4.0 * g, compute_ms=40.0 * f)
        for rank, (f, g) in enumerate(zip(factors, reversed(factors), strict=True))
    ]
    assert findings(splits) == []
    # The same ranks with one of them 30% slower: that one is named.
    splits[4] = split(4, input_ms=4.0, compute_ms=52.0)
    assert [f.subject for f in findings(splits)] == ["rank 4"]


def test_both_thresholds_must_be_crossed() -> None:
    # 20% above the peers' median (22 ms busy) names the rank; 15% does not.
    assert named(job(r3=split(3, compute_ms=24.5)), 3)
    assert not named(job(r3=split(3, compute_ms=23.3)), 3)
    # 10 ms above a 100 ms step is only 10%: nobody.
    hundred = [split(r, input_ms=0.0, compute_ms=100.0) for r in range(3)]
    assert not named([*hundred, split(3, input_ms=0.0, compute_ms=110.0)], 3)
    # 40% slower but a tenth of a 100 ms step (the rest waits on the others): nobody.
    waiting = [split(r, compute_ms=28.8 if r == 3 else 20.0, step_ms=100.0) for r in range(4)]
    assert not named(waiting, 3)
    assert named(job(r3=split(3, compute_ms=28.8)), 3)
    # Sub-millisecond steps 30% apart are timer noise: under the 1 ms floor.
    tiny = [split(r, input_ms=0.05, compute_ms=0.45) for r in range(3)]
    tiny.append(split(3, input_ms=0.05, compute_ms=0.6))
    assert findings(tiny) == []
    # The same proportions ten times larger cross the floor.
    big = [split(t.rank, input_ms=t.input_ms * 10, compute_ms=t.compute_ms * 10) for t in tiny]
    assert [f.subject for f in findings(big)] == ["rank 3"]


def test_ranks_compare_only_with_peers_of_their_label() -> None:
    # A pipeline: stage 1 (ranks 2, 3) computes 4x as long as stage 0 by design.
    stages = [split(r, compute_ms=10.0 if r < 2 else 40.0, peers=r // 2) for r in range(4)]
    assert findings(stages) == []
    # Compared as one group, the same numbers would name stage 1's ranks.
    flat = [split(r, compute_ms=s.compute_ms) for r, s in enumerate(stages)]
    assert findings(flat) != []
    # Within a label, a slow rank is still named.
    stages[3] = split(3, compute_ms=60.0, peers=1)
    assert [f.subject for f in findings(stages)] == ["rank 3"]
    # A rank alone in its label has nobody to be compared with.
    alone = [
        split(0, compute_ms=10.0),
        split(1, compute_ms=10.0),
        split(2, compute_ms=90.0, peers=7),
    ]
    assert findings(alone) == []


# -- hosts ---------------------------------------------------------------------------


def test_a_host_whose_ranks_are_all_slow_for_one_cause_is_one_line() -> None:
    splits = job(r2=split(2, compute_ms=40.0), r3=split(3, compute_ms=40.0))
    found = findings(splits)
    assert len(found) == 1
    assert (found[0].subject, found[0].cause) == ("host h1", "compute")
    assert found[0].line == (
        "host h1 (ranks 2, 3): computes 2.0x as long as the median "
        "(input 2.0 ms, compute 40 ms vs 20 ms)"
    )


def test_a_host_slow_for_two_causes_keeps_its_ranks_lines() -> None:
    splits = job(r2=split(2, compute_ms=40.0), r3=split(3, input_ms=22.0))
    assert [(f.subject, f.cause) for f in findings(splits)] == [
        ("rank 2", "compute"),
        ("rank 3", "input"),
    ]


def test_the_one_host_of_a_single_host_job_does_not_fold() -> None:
    one_host = [split(r, host="solo") for r in range(2)]
    both = [
        Finding("rank 0", "compute", "rank 0 (host solo)", "computes ..."),
        Finding("rank 1", "compute", "rank 1 (host solo)", "computes ..."),
    ]
    assert _fold_hosts(one_host, both) == both
    # The same two findings fold once the job has a second host.
    two_hosts = [*one_host, split(2, host="other")]
    assert [f.who for f in _fold_hosts(two_hosts, both)] == ["host solo (ranks 0, 1):"]


# -- network -------------------------------------------------------------------------


def three_hosts(links: Sequence[float], comm_ms: float = 10.0) -> list[StepSplit]:
    """Two ranks per host; the first rank of each host carries its link's measure."""
    return [
        split(r, comm_ms=comm_ms, step_ms=30.0, link_ms=links[r // 2] if r % 2 == 0 else None)
        for r in range(2 * len(links))
    ]


def test_a_slow_link_is_named_while_communication_is_a_quarter_of_the_step() -> None:
    splits = three_hosts([2.0, 2.0, 20.0])
    assert lines(splits) == [
        "host h2: network: exposed communication is 33% of every step, and its link "
        "measures 10.0x the other hosts' (20 ms vs 2.0 ms per MiB round trip)"
    ]
    assert [(f.subject, f.cause) for f in network_findings(splits)] == [("host h2", "network")]


def test_two_hosts_cannot_tell_which_link_is_slow() -> None:
    assert network_findings(three_hosts([2.0, 20.0])) == []


def test_a_slow_link_matters_only_when_communication_is_a_large_share() -> None:
    assert network_findings(three_hosts([2.0, 2.0, 20.0], comm_ms=5.0)) == []  # 17%
    no_comm = [split(r, link_ms=[2.0, 2.0, 20.0][r]) for r in range(3)]
    assert network_findings(no_comm) == []
    # Links within 3x of each other name nobody, however large the share.
    assert network_findings(three_hosts([2.0, 2.0, 5.0], comm_ms=25.0)) == []


# -- the judge -----------------------------------------------------------------------

SLOW = job(r2=split(2, compute_ms=30.0))
EVEN = job()
LINE = "rank 2 (host h1) computes 50% slower than the median (input 2.0 ms, compute 30 ms vs 20 ms)"


def said(judge: Judge, windows: Sequence[list[StepSplit]]) -> list[list[str]]:
    return [judge.window(w) for w in windows]


def test_the_judge_speaks_after_three_windows_in_a_row_and_once() -> None:
    assert STREAK == 3
    assert said(Judge(streak_s=0.0), [SLOW] * 6) == [[], [], [LINE], [], [], []]


def test_the_streak_must_also_last_five_seconds() -> None:
    # SLOW's windows last 50 steps of its longest step: a burst of three is too short.
    seconds = max(s.step_ms * s.steps for s in SLOW) / 1e3
    assert STREAK_S == 5.0 and 3 * seconds < STREAK_S
    needed = math.ceil(STREAK_S / seconds)
    want = [[] for _ in range(needed - 1)] + [[LINE]]
    assert said(Judge(), [SLOW] * needed) == want


def test_a_broken_streak_starts_the_count_again() -> None:
    judge = Judge(streak_s=0.0)
    assert said(judge, [SLOW, SLOW, EVEN, SLOW, SLOW]) == [[], [], [], [], []]
    assert judge.window(SLOW) == [LINE]
    # Once said, a later streak of the same finding is not repeated.
    assert said(judge, [EVEN, SLOW, SLOW, SLOW]) == [[], [], [], []]


def test_a_change_of_cause_is_a_new_streak() -> None:
    waits = job(r2=split(2, input_ms=12.0))
    assert said(Judge(streak_s=0.0), [SLOW, SLOW, waits, waits]) == [[], [], [], []]
    first = Judge(streak=1, streak_s=0.0).window(waits)[0]
    assert first.startswith("rank 2 (host h1) waits for input")


def test_a_folded_host_line_shows_its_slowest_rank() -> None:
    def one(rank: int, host: str, compute: float) -> StepSplit:
        return StepSplit(rank, host, 0, 50, 92.0, 2.0, compute, None)

    # "rank 10" sorts before "rank 9": the line must follow the numbers, not the names.
    job = [one(0, "a", 20.0), one(1, "a", 20.0), one(9, "b", 90.0), one(10, "b", 30.0)]
    assert [f.line for f in findings(job)] == [
        "host b (ranks 9, 10): computes 4.5x as long as the median (input 2.0 ms, "
        "compute 90 ms vs 20 ms)"
    ]
