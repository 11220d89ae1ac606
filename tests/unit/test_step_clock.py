"""The step clock and the switches of straggler reports.

:class:`StepClock` runs on a fake time (``perf_counter`` and ``time_ns`` of
:mod:`manygpu.observe.step_clock` replaced): window medians, the uncounted first
step, window numbers, compute paired with the probe's sampled step (and its
fallback), the probe's rate and which probe is kept. Then the pure parts around
it: ``steps_every`` and ``render`` of :mod:`manygpu.observe.straggler_board`, the
environment readers of :mod:`manygpu.runtime.env`, and ``ParallelConfig``'s check.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict

import pytest
from rich.console import Console

from manygpu import ParallelConfig
from manygpu.errors import UsageError
from manygpu.observe import step_clock
from manygpu.observe.step_clock import DEFAULT_EVERY, StepClock, StepSplit
from manygpu.observe.straggler_board import render, steps_every
from manygpu.runtime import env as envmod

FUTURE_NS = 10**18
"""A sample's start after every step the clock has seen: it pairs with none."""


class Rig:
    """A clock on fake time, its sink, and a probe that hands out what a step left for it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, every: int) -> None:
        self.ns = 10**12
        monkeypatch.setattr(step_clock, "time", self)
        self.sent: list[StepSplit] = []
        self.clock = StepClock(every, rank=3, host="h1", peers=2, sink=self.sent.append)
        self.calls = 0
        self.sample: tuple[int, float] | None = None

    def perf_counter(self) -> float:
        return self.ns / 1e9

    def time_ns(self) -> int:
        return self.ns

    def probe(self) -> tuple[int, float] | None:
        self.calls += 1
        sample, self.sample = self.sample, None
        return sample

    def step(
        self,
        input_ms: float,
        busy_ms: float,
        exposed_ms: float | None = None,
        *,
        paired: bool = True,
    ) -> None:
        """One step: ``input_ms`` in the loader, then ``busy_ms`` of work, then ``step()``.

        With ``exposed_ms`` the probe's next answer is this step's communication,
        started inside this step (or, unless ``paired``, after every step).
        """
        self.ns += round(input_ms * 1e6)
        self.clock.waited_for_input(input_ms / 1e3)
        started = self.ns + 1
        self.ns += round(busy_ms * 1e6)
        if exposed_ms is not None:
            self.sample = (started if paired else FUTURE_NS, exposed_ms / 1e3)
        self.clock.step()


def test_a_window_is_the_medians_of_its_steps_and_skips_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig(monkeypatch, every=5)
    rig.step(500.0, 500.0)  # before the first step() nothing is timed
    for input_ms, busy_ms in [(1.0, 9.0), (2.0, 10.0), (1.0, 10.0), (50.0, 50.0)]:
        rig.step(input_ms, busy_ms)
    assert rig.sent == []
    rig.step(1.0, 12.0)
    # rank, host, window, steps, then medians: walls, inputs, busy (9, 10, 10, 50, 12)
    assert rig.sent == [StepSplit(3, "h1", 0, 5, 12.0, 1.0, 10.0, comm_ms=None, peers=2)]


def test_windows_are_numbered_and_start_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, every=3)
    rig.step(0.0, 1.0)
    for busy_ms in [10.0] * 3 + [20.0] * 3 + [30.0] * 3:
        rig.step(2.0, busy_ms)
    assert [(s.window, s.steps, s.step_ms, s.compute_ms) for s in rig.sent] == [
        (0, 3, 12.0, 10.0),
        (1, 3, 22.0, 20.0),
        (2, 3, 32.0, 30.0),
    ]


def test_time_that_was_not_training_is_left_out_of_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig(monkeypatch, every=2)
    rig.clock.exclude(5.0)  # before the first step: nothing to leave out
    rig.step(0.0, 1.0)
    rig.ns += round(900 * 1e6)  # a profile window writes its trace after the step
    rig.clock.exclude(0.9)
    rig.step(1.0, 9.0)
    rig.step(1.0, 9.0)
    assert [(s.step_ms, s.compute_ms) for s in rig.sent] == [(10.0, 9.0)]


def test_input_wait_longer_than_the_step_leaves_no_negative_compute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig(monkeypatch, every=2)
    rig.step(0.0, 1.0)
    for _ in range(2):
        rig.clock.waited_for_input(1.0)  # more than the step's wall time
        rig.step(1.0, 4.0)
    assert (rig.sent[0].step_ms, rig.sent[0].compute_ms) == (5.0, 0.0)


# Per step: busy time and its exposed communication. Median of the differences
# (15) and difference of the medians (55 - 27 = 28) disagree on purpose.
BUSY = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
EXPOSED = [9.0, 1.0, 1.0, 1.0, 1.0, 45.0, 55.0, 65.0, 75.0, 85.0]


def run_sampled(rig: Rig, busy: Sequence[float], exposed: Sequence[float], paired: bool) -> None:
    rig.clock.attach(rig.probe)
    rig.step(0.0, 1.0)
    for busy_ms, exposed_ms in zip(busy, exposed, strict=True):
        rig.step(2.0, busy_ms, exposed_ms, paired=paired)


def test_compute_is_each_sampled_step_less_its_own_communication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig(monkeypatch, every=10)
    assert rig.clock.probe_every == 1
    run_sampled(rig, BUSY, EXPOSED, paired=True)
    (split,) = rig.sent
    assert split.compute_ms == statistics.median(b - e for b, e in zip(BUSY, EXPOSED, strict=True))
    assert (split.compute_ms, split.comm_ms, split.step_ms) == (15.0, 27.0, 57.0)


def test_a_sample_pairs_with_the_step_it_started_in(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, every=20)
    rig.clock.attach(rig.probe)
    assert rig.clock.probe_every == 2
    rig.step(0.0, 1.0)  # step() call 1; the probe is read on even calls
    for call in range(2, 22):
        # Odd calls: a 30 ms step whose 10 ms of communication the probe reports
        # one step later, after a 100 ms step with no sample.
        if call % 2:
            rig.step(0.0, 30.0, 10.0)
        else:
            rig.step(0.0, 100.0)
    (split,) = rig.sent
    assert rig.calls == 10
    assert (split.compute_ms, split.comm_ms, split.step_ms) == (20.0, 10.0, 65.0)


def test_without_a_pairing_compute_is_busy_less_communication_as_medians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig(monkeypatch, every=10)
    run_sampled(rig, BUSY, EXPOSED, paired=False)
    (split,) = rig.sent
    assert (split.compute_ms, split.comm_ms) == (28.0, 27.0)


def test_no_probe_or_no_sample_leaves_communication_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for attach in (False, True):
        rig = Rig(monkeypatch, every=4)
        if attach:
            rig.clock.attach(rig.probe)  # a probe with nothing to say
        rig.step(0.0, 1.0)
        for _ in range(4):
            rig.step(1.0, 6.0)
        assert (rig.sent[0].comm_ms, rig.sent[0].compute_ms) == (None, 6.0)
        assert rig.calls == (5 if attach else 0)


def test_the_first_probe_attached_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, every=10)
    later: list[int] = []

    def second() -> tuple[int, float] | None:
        later.append(1)
        return None

    rig.clock.attach(None)  # a model whose strategy cannot probe blocks nothing
    rig.clock.attach(rig.probe)
    rig.clock.attach(second)
    for _ in range(5):
        rig.step(0.0, 1.0)
    assert (rig.calls, later) == (5, [])


@pytest.mark.parametrize(("every", "probe_every"), [(1, 1), (9, 1), (10, 1), (25, 2), (50, 5)])
def test_the_probe_is_read_about_ten_times_a_window(
    monkeypatch: pytest.MonkeyPatch, every: int, probe_every: int
) -> None:
    rig = Rig(monkeypatch, every=every)
    rig.clock.attach(rig.probe)
    assert rig.clock.probe_every == probe_every
    for _ in range(1 + 2 * every):
        rig.step(0.0, 1.0)
    assert rig.calls == (1 + 2 * every) // probe_every
    assert len(rig.sent) == 2


# -- switches: steps_every, MANYGPU_STRAGGLERS, ParallelConfig, the table -----------


def test_steps_every() -> None:
    assert steps_every(False, {}) is None
    assert steps_every(False, {"MANYGPU_STRAGGLERS": "25"}) is None
    assert steps_every(True, {"MANYGPU_STRAGGLERS": "0"}) is None
    assert steps_every(7, {"MANYGPU_STRAGGLERS": "0"}) is None
    assert steps_every(7, {"MANYGPU_STRAGGLERS": "25"}) == 7
    assert steps_every(7, {}) == 7
    assert steps_every(True, {"MANYGPU_STRAGGLERS": "25"}) == 25
    assert steps_every(True, {}) == DEFAULT_EVERY == 50
    with pytest.raises(UsageError, match="MANYGPU_STRAGGLERS=-5 must be 0"):
        steps_every(True, {"MANYGPU_STRAGGLERS": "-5"})


def test_environment_readers() -> None:
    assert envmod.straggler_every({}) is None
    assert envmod.straggler_every({"MANYGPU_STRAGGLERS": ""}) is None
    assert envmod.straggler_every({"MANYGPU_STRAGGLERS": "0"}) == 0
    with pytest.raises(UsageError, match="not an integer"):
        envmod.straggler_every({"MANYGPU_STRAGGLERS": "often"})
    assert envmod.host_label({"MANYGPU_HOST": "10.0.0.7"}) == "10.0.0.7"
    assert envmod.host_label({"MANYGPU_HOST": ""}) is None
    assert envmod.host_label({}) is None
    assert envmod.restart_count({}) == 0
    assert envmod.restart_count({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3


def test_parallel_config_checks_stragglers() -> None:
    for bad in (0, -1, "x", 2.5):
        with pytest.raises(UsageError, match="stragglers takes True, False or steps"):
            ParallelConfig(stragglers=bad)  # type: ignore[arg-type]
    assert ParallelConfig(stragglers=7).stragglers == 7
    assert ParallelConfig(stragglers=False).stragglers is False
    assert ParallelConfig().stragglers is True


def test_render_lists_ranks_in_order_one_decimal_dashes_for_unknowns() -> None:
    one = StepSplit(3, "beta", 4, 50, 31.5, 2.31, 20.0, None, link_ms=None)
    zero = StepSplit(0, "alpha", 4, 50, 30.0, 1.5, 18.26, 10.5, link_ms=0.74)
    console = Console(record=True, width=200)
    console.print(render([asdict(one), asdict(zero)]))
    text = console.export_text()
    assert "step times per rank (median of 50 steps)" in text
    for title in (
        "rank",
        "host",
        "step ms",
        "input ms",
        "compute ms",
        "exposed comm ms",
        "rest ms",
        "link ms",
    ):
        assert title in text
    rows = [line.split() for line in text.splitlines() if "alpha" in line or "beta" in line]
    cells = [[c for c in row if c not in "│┃|"] for row in rows]
    # rest: the step less its parts (medians each: below 0 where they overlap); no
    # exposed comm known counts as 0.
    assert cells == [
        ["0", "alpha", "30.0", "1.5", "18.3", "10.5", "-0.3", "0.7"],  # one decimal
        ["3", "beta", "31.5", "2.3", "20.0", "-", "9.2", "-"],
    ]
    said = " ".join(text.split())
    assert "need not add up to the step" in said and "rest ms is the step less its parts" in said
    assert "one rank per host times its host's round trip" in said


def test_a_sample_older_than_every_remembered_step_pairs_with_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig(monkeypatch, every=10)
    rig.clock.attach(rig.probe)
    rig.step(0.0, 5.0)
    for _ in range(9):
        rig.sample = (1, 0.010)  # started long before the clock's first step
        rig.step(0.0, 40.0)
    assert len(rig.clock._comms) == 9  # counted as communication...
    assert rig.clock._computes == []  # ...but paired with no step
