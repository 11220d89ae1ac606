"""par.log adds the job's samples/s by itself, counted from the prepared training loaders."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import tracking_read as read
from torch.utils.data import DataLoader, TensorDataset

from manygpu import Parallel
from manygpu.observe.profiling import ProfileWindow
from manygpu.observe.throughput import KEY, SampleMeter


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_meter_counts_from_the_first_batch_asked_for_and_scales_by_shards() -> None:
    clock = FakeClock()
    meter = SampleMeter(clock)
    assert meter.take(2) == {}  # no batch yet: no figure
    clock.now = 110.0
    meter.batch(8, 1.0)  # asked for at 109
    clock.now = 111.0
    meter.batch(8, 0.5)
    clock.now = 113.0
    assert meter.take(2) == {KEY: 16 * 2 / 4.0}
    clock.now = 200.0  # an evaluation between the log and the next batch is not counted
    meter.batch(8, 0.0)
    clock.now = 202.0
    assert meter.take(1) == {KEY: 8 / 2.0}
    assert meter.take(1) == {}  # no batch since the last log
    meter.exclude(50.0)  # nothing to leave out before the interval begins
    meter.batch(8, 0.0)
    clock.now = 203.0  # a profile window writes its trace for 1 s of the next 2
    meter.exclude(1.0)
    clock.now = 204.0
    assert meter.take(1) == {KEY: 8 / 1.0}


def test_a_user_logging_only_the_loss_sees_samples_per_second(tmp_path: Path) -> None:
    data = TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    with Parallel(log_with="jsonl", run_dir=str(tmp_path)) as par:
        model = par.prepare(torch.nn.Linear(3, 1))
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        train = par.prepare(DataLoader(data, batch_size=4, shuffle=True))
        test = par.prepare_loader(DataLoader(data, batch_size=10), train=False)
        for x, y in train:
            loss = torch.nn.functional.mse_loss(model(x), y)
            par.backward(loss)
            opt.step()
            opt.zero_grad()
            par.log({"loss": loss})
        for _ in test:  # an evaluation loader is not training throughput
            pass
        par.log({"loss": 0.0})
        run_id = par.job_state.tracking()["run_id"]  # type: ignore[index]
    records = [r for r in read.jsonl(tmp_path / run_id / "metrics.jsonl") if "step" in r]
    assert len(records) == 11
    rates = [r["values"].get(KEY) for r in records]
    assert all(rate is not None and rate > 0 for rate in rates[:10]), rates
    assert rates[10] is None  # no training batch since the last log
    assert all("loss" in r["values"] for r in records)


def test_a_profile_windows_trace_write_is_not_in_the_samples_per_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_write = ProfileWindow._ready

    def ready(self: ProfileWindow, prof: object) -> None:
        time.sleep(1.0)  # a big trace: a second to write, after the window's last step
        slow_write(self, prof)

    monkeypatch.setattr(ProfileWindow, "_ready", ready)
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    with Parallel(log_with="jsonl", run_dir=str(tmp_path)) as par:
        model = par.prepare(torch.nn.Linear(3, 1))
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        train = par.prepare(DataLoader(data, batch_size=4))
        with par.profile(range(2, 4), dir=tmp_path / "profile") as window:
            for x, y in train:
                par.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
                par.log({"lr": 0.1})
        run_id = par.job_state.tracking()["run_id"]  # type: ignore[index]
    assert window.trace is not None
    rates = [r["values"][KEY] for r in read.jsonl(tmp_path / run_id / "metrics.jsonl")
             if "step" in r]  # fmt: skip
    # A step here is a millisecond or so: with the write counted, step 3's figure
    # would be about 4 / 1.0 samples/s.
    assert len(rates) == 8 and min(rates) > 20, rates  # 0.2 s a step: a loaded machine


def test_a_short_last_batch_counts_the_samples_it_holds() -> None:
    data = TensorDataset(torch.randn(10, 3), torch.randn(10, 1))
    with Parallel(log_with="jsonl") as par:
        meter = par.job_log._meter = SampleMeter()  # the one the prepared loader feeds
        train = par.prepare(DataLoader(data, batch_size=4))
        assert [len(x) for x, _ in train] == [4, 4, 2]
        assert meter.samples == 10  # not 3 batches x 4
