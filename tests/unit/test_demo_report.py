"""The demo's closing line: a speed-up only when there is something to compare."""

from __future__ import annotations

import pytest

from manygpu.demo.train import DemoResult, summary


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
