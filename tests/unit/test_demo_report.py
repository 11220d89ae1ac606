"""The demo's closing line: a speed-up only when there is something to compare, as the
median of timing windows with its spread and the load; and its first line, said at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from manygpu.cli import demo as cli_demo
from manygpu.cli.demo import announcement
from manygpu.cli.main import main
from manygpu.core.parallel import Parallel
from manygpu.demo.train import DemoResult, report, summary
from manygpu.demo.windows import Load, Spread, Window, busy, speedup_spread, spread


def _result(workers: int, single: float | None) -> DemoResult:
    return DemoResult(
        strategy="ddp", precision="fp32", workers=workers, device="cuda:0", threads_per_worker=1,
        global_batch=64, epochs=2, losses=[1.0, 0.5], accuracies=[0.9, 0.975],
        samples_per_s=1000.0, single_worker_samples_per_s=single,
    )  # fmt: skip


def test_one_device_says_so_instead_of_a_speedup() -> None:
    """One worker against one worker measured noise ("speed-up 0.81x, efficiency 81%")."""
    result = _result(1, None)
    assert result.speedup is None and result.efficiency is None
    line = summary(result)
    assert "97.50%" in line and "1,000 samples/s on one worker (cuda:0)" in line
    assert "One device, so no speed-up to measure" in line
    assert "with N devices" in line and "scaling efficiency of 100%" in line
    assert "speed-up 0" not in line and "x," not in line


def test_several_workers_report_speedup_and_efficiency() -> None:
    result = _result(2, 625.0)
    assert result.speedup == pytest.approx(1.6) and result.efficiency == pytest.approx(0.8)
    line = summary(result)
    assert "with 2 workers vs 625 with one: speed-up 1.60x, scaling efficiency 80%" in line


# -- the speed-up over timing windows: median, spread, load -----------------------
def test_spread_is_median_low_high() -> None:
    s = spread([1.2, 1.5, 1.0, 1.4, 1.3])
    assert s == Spread(median=1.3, low=1.0, high=1.5, windows=5)
    assert s.relative == pytest.approx(0.5 / 1.3) and s.noisy
    assert spread([2.0, 4.0]) == Spread(3.0, 2.0, 4.0, 2) and spread([]) is None
    assert not Spread(1.4, 1.35, 1.45, 5).noisy


def test_windows_give_the_median_speedup_not_one_slow_stretch() -> None:
    """One window hit by other work (0.5x) does not set the speed-up, as one long
    measurement did (1.49x, then 1.04x on the same machine)."""
    windows = [Window(900.0, 600.0), Window(300.0, 600.0), Window(880.0, 550.0)]
    assert [w.speedup for w in windows] == [1.5, 0.5, 1.6]
    assert speedup_spread(windows) == Spread(1.5, 0.5, 1.6, 3)
    assert speedup_spread([Window(900.0), Window(800.0)]) is None  # one worker: nothing to compare
    result = _result(2, 600.0)
    result.windows = windows
    assert result.speedup == 1.5 and result.efficiency == pytest.approx(0.75)


def test_busy_counts_only_other_work() -> None:
    # The demo's own 2 workers raise the end's average; that alone is not "busy".
    assert not busy(Load(start=0.2, end=2.1, cpus=4), own_workers=2)
    assert busy(Load(start=2.5, end=2.0, cpus=4), own_workers=2)
    assert busy(Load(start=0.1, end=5.0, cpus=4), own_workers=2)


def test_summary_reports_median_spread_and_load() -> None:
    result = _result(2, 600.0)
    result.windows = [Window(900.0, 600.0), Window(880.0, 550.0), Window(870.0, 600.0)]
    result.load = Load(start=0.3, end=2.2, cpus=8)
    line = summary(result)
    assert "speed-up 1.50x (median of 3 windows, 1.45x-1.60x), scaling efficiency 75%" in line
    assert "load average 0.3 at the start, 2.2 at the end, on 8 CPUs" in line
    assert "noisy" not in line
    result.load = Load(start=6.0, end=8.0, cpus=8)
    assert "other work shared the CPUs, so the speed-up is noisy" in summary(result)
    result.load = Load(start=0.3, end=2.2, cpus=8)
    result.windows.append(Window(300.0, 600.0))
    assert "the windows disagree by 75%, so the speed-up is noisy" in summary(result)
    result.windows = result.windows[:1]
    assert "speed-up 1.50x (one timing window; more --epochs give a median)" in summary(result)


def test_json_payload_has_windows_spread_and_load(tmp_path: Path) -> None:
    result = _result(2, 600.0)
    result.windows = [Window(900.0, 600.0), Window(880.0, 550.0)]
    result.load = Load(start=0.5, end=1.5, cpus=2)
    out = tmp_path / "demo.json"
    with Parallel(strategy="single") as par:
        report(par, result, str(out))
    data = json.loads(out.read_text())
    assert data["windows"][1] == {"workers_samples_per_s": 880.0, "single_samples_per_s": 550.0}
    assert data["speedup_spread"] == {"median": 1.55, "low": 1.5, "high": 1.6, "windows": 2}
    assert data["speedup"] == 1.55 and data["load"] == {"start": 0.5, "end": 1.5, "cpus": 2}


# -- the command speaks before anything slow --------------------------------------
def test_demo_says_what_it_will_do_before_it_launches(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo was silent for 10-20 s (PyTorch, the launcher, the workers' start):
    its first line now comes before any of that."""
    seen: list[str] = []

    def launched(spec: object) -> int:  # stands in for the workers: what was said by then
        seen.append(capsys.readouterr().out)
        return 0

    monkeypatch.setattr(cli_demo, "launch_spec", launched)
    assert main(["demo", "--workers", "2", "--epochs", "4"]) == 0
    (before,) = seen
    first, second = before.splitlines()
    assert first.startswith("manygpu demo: training a small CNN") and "4 epoch(s)" in first
    assert "on 2 worker(s)" in first and "3 epoch(s) are timed" in first
    assert second == "manygpu demo: launching 2 worker process(es)"


def test_the_first_line_needs_no_torch() -> None:
    """Said before PyTorch is imported: a function of the options only."""
    line = announcement(6, None)
    assert "every local GPU (or 2 CPU workers)" in line and "5 epoch(s) are timed" in line
    assert "1 epoch(s) are timed" in announcement(1, 3)
    assert "speed-up" not in announcement(3, 1)  # one worker: nothing to compare
