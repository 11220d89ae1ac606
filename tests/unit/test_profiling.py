"""par.profile in one process: the split's arithmetic, the trace of a window, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from reference import make_data, make_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manygpu import Parallel
from manygpu.errors import UsageError
from manygpu.observe.kineto_quiet import QuietProfilerCalls
from manygpu.observe.profile_split import ProfileSummary, RankTimes, Span, split
from manygpu.observe.profiling import default_dir, local_name, torchrun_id, trace_name


def _span(name: str, start_ms: float, end_ms: float) -> Span:
    return Span(name, start_ms * 1e3, end_ms * 1e3)


def test_split_counts_collectives_in_flight_as_communication() -> None:
    spans = [
        _span("ProfilerStep#3", 0, 100),
        _span("ProfilerStep#4", 100, 200),
        _span("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 10),
        _span("aten::mm", 10, 30),
        _span("gloo:all_reduce", 30, 95),  # on a gloo thread, waiting for a peer
        _span("c10d::allreduce_", 30, 31),  # the launch, inside the same time: counted once
        _span("nccl:all_reduce", 180, 260),  # cut at the window's end
    ]
    times = split(spans, rank=1, host="node2")
    assert (times.steps, times.step_ms) == (2, 100.0)
    assert times.comm_ms == pytest.approx((65 + 20) / 2)
    assert times.input_ms == pytest.approx(10 / 2)
    assert times.compute_ms == pytest.approx((200 - 85 - 10) / 2)


def test_split_without_a_dataloader_does_not_invent_an_input_wait() -> None:
    times = split([_span("ProfilerStep#0", 0, 10), _span("aten::add", 1, 2)], rank=0, host="a")
    assert times.input_ms is None
    assert (times.compute_ms, times.comm_ms) == (10.0, 0.0)


def _times(rank: int, host: str, compute: float, comm: float) -> RankTimes:
    return RankTimes(rank=rank, host=host, steps=3, step_ms=compute + comm,
                     compute_ms=compute, comm_ms=comm, input_ms=None)  # fmt: skip


def test_summary_names_the_slowest_rank_and_its_host_per_phase() -> None:
    summary = ProfileSummary(5, 8, (_times(0, "a", 2, 40), _times(1, "b", 41, 1)), "runs/x")
    assert summary.slowest("compute") == summary.ranks[1]
    assert summary.slowest("comm") == summary.ranks[0]
    assert summary.slowest("input") is None
    lines = summary.lines()
    assert lines[0].startswith("manygpu: profile of steps 5..7 on 2 rank(s)")
    assert "compute: rank 1 (b) 41.0 ms; comm: rank 0 (a) 40.0 ms" in lines[-1]


@pytest.mark.parametrize(
    "sent",
    [
        {"rank": 0},
        {**_times(0, "a", 1, 1).to_json(), "rank": "0"},
        {**_times(0, "a", 1, 1).to_json(), "comm_ms": "1"},
        {**_times(0, "a", 1, 1).to_json(), "extra": 1},
        [1, 2],
    ],
)
def test_rank_times_refuse_what_manygpu_does_not_send(sent: object) -> None:
    with pytest.raises((TypeError, KeyError)):
        RankTimes.from_json(sent)  # type: ignore[arg-type]
    assert RankTimes.from_json(_times(0, "a", 1, 1).to_json()) == _times(0, "a", 1, 1)


def test_default_directory_and_trace_names() -> None:
    assert torchrun_id({}) is None and torchrun_id({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert default_dir("out", torchrun_id({"TORCHELASTIC_RUN_ID": "job/7"}) or "") == Path(
        "out/job_7/profile"
    )
    # Without torchrun's id a run is named by its start and process: runs do not overwrite.
    name = local_name(0.0, 1234)
    assert name.startswith("local-") and name.endswith("-1234") and name != local_name(1.0, 1234)
    assert default_dir(None, name) == Path("runs") / name / "profile"
    assert trace_name(1, "node2") == "trace-rank1-node2.json"
    assert trace_name(0, "a b/c") == "trace-rank0-a_b_c.json"


class _Loop:
    """A prepared model, optimizer and DataLoader; each step marked by its number."""

    def __init__(self, par: Parallel) -> None:
        self.par = par
        model = make_model()
        self.model, self.opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = make_data(64)
        self.loader = par.prepare_loader(DataLoader(TensorDataset(x, y), batch_size=4))

    def run(self, steps: int) -> None:
        for _, (xb, yb) in zip(range(steps), self.loader, strict=False):
            with torch.profiler.record_function(f"user_step_{self.par.events.done}"):
                self.par.backward(nn.functional.mse_loss(self.model(xb), yb))
                self.opt.step()
                self.opt.zero_grad()


def _train(par: Parallel, steps: int) -> _Loop:
    loop = _Loop(par)
    loop.run(steps)
    return loop


def _marks(trace: Path, prefix: str) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith(prefix)})


def test_a_window_records_its_steps_only_and_prints_the_summary(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with Parallel(strategy="single") as par:
        window = par.profile(steps=range(2, 4), dir=tmp_path)
        _train(par, 6)
    assert window.trace == tmp_path / window.trace.name
    assert window.trace.name.startswith("trace-rank0-")
    assert _marks(window.trace, "user_step_") == ["user_step_2", "user_step_3"]
    assert _marks(window.trace, "ProfilerStep#") == ["ProfilerStep#2", "ProfilerStep#3"]
    assert json.loads(window.trace.read_text())["manygpu"]["steps"] == [2, 4]
    assert window.summary is not None and window.summary.ranks[0].steps == 2
    assert window.summary.ranks[0].input_ms is not None  # the DataLoader's waits were seen
    out, err = capfd.readouterr()  # the descriptors: torch's C++ writes to 2 itself
    assert "manygpu: profile of steps 2..3 on 1 rank(s)" in out
    assert "profiler_start" not in err and "profiler_stop" not in err and "USDT" not in err


def test_kinetos_progress_lines_are_dropped_and_its_errors_kept(
    capfd: pytest.CaptureFixture[str],
) -> None:
    quiet = QuietProfilerCalls()
    for word in ("start", "stop"):
        with quiet():
            os.write(2, f"USDT:2026-11-28 02:36:37 1:1 Sync.cpp:52] profiler_{word}\n".encode())
            os.write(2, b"STAGE:2026-11-28 02:36:37 1:1 Sync.cpp:51] Completed Stage: Warm Up\n")
            os.write(2, f"ERROR:2026-11-28 02:36:37 1:1 Cupti.cpp:9] failed {word}\n".encode())
    quiet.close()
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert err.splitlines() == [
        "ERROR:2026-11-28 02:36:37 1:1 Cupti.cpp:9] failed start",
        "ERROR:2026-11-28 02:36:37 1:1 Cupti.cpp:9] failed stop",
        "after",
    ]


@pytest.mark.parametrize("window_steps", [range(3, 4), range(4, 6), range(6, 8)])
def test_a_window_armed_late_keeps_the_jobs_step_numbers(
    tmp_path: Path, window_steps: range
) -> None:
    """Armed at step 3: recording at once, after a warm-up step, or after waiting."""
    with Parallel(strategy="single") as par:
        loop = _train(par, 3)
        with par.profile(steps=window_steps, dir=tmp_path) as window:
            loop.run(6)
    assert window.trace is not None
    assert _marks(window.trace, "ProfilerStep#") == [f"ProfilerStep#{s}" for s in window_steps]
    assert _marks(window.trace, "user_step_") == [f"user_step_{s}" for s in window_steps]


def test_a_loop_that_ends_inside_the_window_still_writes_its_trace(tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        window = par.profile(steps=range(1, 10), dir=tmp_path)
        with pytest.warns(UserWarning, match="ended at step 3"), window:
            _train(par, 3)
    assert window.trace is not None
    assert _marks(window.trace, "user_step_") == ["user_step_1", "user_step_2"]


@pytest.mark.parametrize(
    ("steps", "words"),
    [
        (range(3, 3), "is empty: give at least one step"),
        (range(-2, 3), "numbered from 0"),
        (range(0, 10, 2), "skips steps"),
        ([1, 2], "takes a range of step numbers"),
        (range(1, 4), "has done 2 steps already"),
    ],
)
def test_bad_windows_are_one_usage_line(steps: object, words: str, tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        _train(par, 2)
        with pytest.raises(UsageError, match=words) as caught:
            par.profile(steps=steps, dir=tmp_path)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)


def test_without_dir_traces_go_under_the_run_directory(tmp_path: Path) -> None:
    with Parallel(strategy="single", run_dir=str(tmp_path)) as par:
        window = par.profile(steps=range(0, 1))
        _train(par, 2)
    assert window.trace is not None and window.trace.parent.name == "profile"
    run = window.trace.parent.parent
    assert run.parent == tmp_path and run.name.startswith("local-")  # named per run


def test_a_logging_job_profiles_beside_its_trackers_records(tmp_path: Path) -> None:
    with Parallel(strategy="single", run_dir=str(tmp_path), log_with=["jsonl"]) as par:
        window = par.profile(steps=range(0, 1))
        _train(par, 2)
        par.log({"loss": 1.0})
        run_id = par.job_state.tracking()["run_id"]  # type: ignore[index]
    assert window.trace is not None
    assert window.trace.parent == tmp_path / run_id / "profile"
    assert (tmp_path / run_id / "metrics.jsonl").exists()


def test_one_window_at_a_time_and_a_directory_not_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.warns(UserWarning, match="nothing was recorded"), Parallel() as par:
        with pytest.raises(UsageError, match="is a file"):
            par.profile(steps=range(0, 2), dir=tmp_path / "f")
        par.profile(steps=range(5, 7), dir=tmp_path)
        with pytest.raises(UsageError, match="still running"):
            par.profile(steps=range(8, 9), dir=tmp_path)
