"""``par.profile(steps=range(a, b))``: torch.profiler on every rank for those steps only.

The prepared optimizer's step is the step boundary users already mark, so the
window follows it: step ``k`` is the work up to and including the job's
``k``-th optimizer step (counted from 0, on steps that apply an update; a
``Checkpointer`` resume continues the count from its checkpoint's step), and
nothing outside ``[a, b)`` is recorded (torch's ``schedule``: one warm-up step
before ``a`` when there is one, so the first recorded step does not pay for
the profiler's start). When step ``b - 1`` ends each rank writes its trace,
``trace-rank{rank}-{host}.json`` (Chrome trace format: Perfetto or
``chrome://tracing``), and the ranks exchange their split (compute,
communication, input; :mod:`manygpu.observe.profile_split`) in one small JSON
all-gather — no pickle — after which the main rank prints the comparison.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from manygpu.comm.objects import all_gather_json, broadcast_json, parse_each
from manygpu.errors import UsageError
from manygpu.observe.kineto_quiet import QuietProfilerCalls
from manygpu.observe.profile_split import ProfileSummary, RankTimes, Span, split
from manygpu.runtime import env as envmod
from manygpu.warn import warn_user

if TYPE_CHECKING:
    from torch.profiler import profile as TorchProfile


def check_steps(steps: object, done: int) -> range:
    """``steps`` as a window that can still be profiled, or one :class:`UsageError` line."""
    if not isinstance(steps, range):
        raise UsageError(
            f"profile(steps=...) takes a range of step numbers, e.g. steps=range(10, 15), "
            f"not {steps!r}"
        )
    if steps.step != 1:
        raise UsageError(f"profile(steps={steps!r}) skips steps: give consecutive ones, e.g. "
                         f"steps=range({steps.start}, {steps.stop})")  # fmt: skip
    if steps.start < 0:
        raise UsageError(
            f"profile(steps={steps!r}): steps are numbered from 0 (the first optimizer step); "
            f"give a range of steps >= 0, e.g. steps=range(0, {max(1, steps.stop)})"
        )
    if len(steps) == 0:
        raise UsageError(f"profile(steps={steps!r}) is empty: give at least one step, "
                         f"e.g. steps=range({steps.start}, {steps.start + 3})")  # fmt: skip
    if steps.start < done:
        raise UsageError(
            f"profile(steps={steps!r}): this job has done {done} steps already; profile "
            f"a window still ahead, e.g. steps=range({done + 1}, {done + 1 + len(steps)})"
        )
    return steps


def torchrun_id(env: envmod.Environ) -> str | None:
    """torchrun's run id, safe as a file name (``None``: not set, or torchrun's ``none``)."""
    run = envmod.get_str(env, "TORCHELASTIC_RUN_ID")
    return None if run is None or run == "none" else re.sub(r"[^\w.-]", "_", run)


def local_name(now: float, pid: int) -> str:
    """``local-20260102-030405-1234``: a run without torchrun's id, named by when and which
    process started it, so a second run does not overwrite the first one's traces."""
    return f"local-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{pid}"


def default_dir(run_dir: str | Path | None, job: str) -> Path:
    """``<run_dir>/<job>/profile``; ``run_dir`` defaults to ``./runs``."""
    return Path(run_dir if run_dir is not None else "runs") / job / "profile"


def trace_name(rank: int, host: str) -> str:
    """``trace-rank1-node2.json``: the rank and its host, safe as a file name."""
    safe = re.sub(r"[^\w.-]", "_", host)
    return f"trace-rank{rank}-{safe}.json"


class ProfileWindow:
    """One armed window; a context manager that ends it where the ``with`` ends.

    Attributes filled when the window ends: :attr:`trace` (this rank's file)
    and :attr:`summary` (every rank's split, on every rank).
    """

    def __init__(
        self, steps: range, directory: Path, *, done: int, rank: int, host: str,
        device: torch.device, timeout_s: float, say: Callable[[str], None],
        paused: Callable[[float], None] = lambda _s: None,
    ) -> None:  # fmt: skip
        """``paused``: told how long the profiler's own work after a step took (its start,
        the trace's write, the summary), which the step timings then leave out."""
        self.steps, self.directory, self.rank, self.host = steps, directory, rank, host
        self._timeout_s, self._say, self._paused = timeout_s, say, paused
        self.trace: Path | None = None
        self.summary: ProfileSummary | None = None
        self._times: RankTimes | None = None
        self._done = done
        self._device = device
        # One warm-up step before the window when there is one: torch's start is
        # not free, and the first recorded step should not pay for it.
        self._begin = steps.start - (1 if steps.start > done else 0)
        self._prof: TorchProfile | None = None
        self._quiet = QuietProfilerCalls()  # torch's start/stop lines, not on every rank
        self._ended = False
        self._start_if_due()

    @property
    def active(self) -> bool:
        """Whether the window has not ended yet."""
        return not self._ended

    def after_step(self) -> None:
        """An optimizer step ended: advance torch's schedule; finish after the last step."""
        if self._ended:
            return
        began = time.perf_counter()
        try:
            self._advance()
        finally:
            self._paused(time.perf_counter() - began)

    def _advance(self) -> None:
        self._done += 1
        if self._prof is not None:
            with self._quiet():
                self._prof.step()  # at the last step this stops the trace and calls _ready
        self._start_if_due()
        if self._done >= self.steps.stop:
            self._finish(gather=True)

    def _start_if_due(self) -> None:
        """Start torch's profiler when the step before the window begins (not earlier:
        each step of an idle profiler still costs tens of microseconds)."""
        if self._prof is None and self._done == self._begin:
            about = {
                "rank": self.rank,
                "host": self.host,
                "steps": [self.steps.start, self.steps.stop],
            }
            with self._quiet():
                self._prof = _start(self.steps, self._begin, self._device, self._ready, about)

    def close(self, *, gather: bool = False) -> None:
        """End the window now (training ended first): write what was recorded, if anything."""
        if self._ended:
            return
        began = time.perf_counter()
        try:
            self._close(gather=gather)
        finally:
            self._paused(time.perf_counter() - began)

    def _close(self, *, gather: bool) -> None:
        if self._done < self.steps.stop:
            warn_user(
                f"profile of steps {self.steps.start}..{self.steps.stop - 1} ended at step "
                f"{self._done}, before its window did: "
                + ("nothing was recorded" if self._done <= self.steps.start else "trace cut short")
            )
        self._finish(gather=gather and self._done > self.steps.start)

    def __enter__(self) -> ProfileWindow:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        # After an exception the ranks are not in step: no collective then.
        self.close(gather=kind is None)

    def _ready(self, prof: TorchProfile) -> None:
        """torch's ``on_trace_ready``: the window's recording is complete."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / trace_name(self.rank, self.host)
        prof.export_chrome_trace(str(path))
        self.trace = path
        spans = (Span(e.name, e.time_range.start, e.time_range.end) for e in prof.events())
        self._times = split(spans, rank=self.rank, host=self.host)

    def _finish(self, *, gather: bool) -> None:
        prof, self._prof, self._ended = self._prof, None, True
        if prof is not None:
            with self._quiet():
                prof.__exit__(None, None, None)  # a cut-short window exports here (_ready)
        self._quiet.close()
        if gather and self._times is not None:
            self.summary = self._gather(self._times)
            for line in self.summary.lines():
                self._say(line)

    def _gather(self, mine: RankTimes) -> ProfileSummary:
        sent = all_gather_json(
            mine.to_json(), operation="profile summary", timeout_s=self._timeout_s
        )
        ranks = parse_each(sent, RankTimes.from_json, operation="profile summary")
        return ProfileSummary(self.steps.start, self.steps.stop, tuple(ranks), str(self.directory))


def _start(
    steps: range, begin: int, device: torch.device, ready: Callable[[Any], None],
    about: dict[str, Any],
) -> Any:  # fmt: skip
    """torch's profiler, started at the job's step ``begin`` (a warm-up step when it is
    before ``steps``), recording ``steps`` only; ``about`` goes in the trace's metadata."""
    from torch.profiler import ProfilerActivity, profile, schedule

    warmup = steps.start - begin
    with warnings.catch_warnings():
        # A window that opens at the loop's first step has no step to warm up on;
        # docs/tracking.md says so once, torch would say it on every rank.
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
        cycle = schedule(wait=0, warmup=warmup, active=len(steps), repeat=1)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        # torch counts its steps from 0; its step_num set to the job's step makes
        # its ProfilerStep#N marks the job's step numbers, so the schedule is shifted.
        schedule=lambda step: cycle(max(0, step - begin)),
        on_trace_ready=ready,
    )
    prof.step_num = begin
    prof.preset_metadata_json("manygpu", json.dumps(about))  # before start: a trace may begin there
    prof.start()
    return prof


class Profiler:
    """``par.profile``: arms windows over the job's steps (a listener of its step event)."""

    def __init__(
        self, *, rank: int, device: torch.device, timeout_s: float, run_dir: str | None,
        run_id: Callable[[], str] | None, steps_done: Callable[[], int],
        say: Callable[[str], None], paused: Callable[[float], None] = lambda _s: None,
    ) -> None:  # fmt: skip
        """``run_id``: the trackers' run id when the job logs (``None``: it does not);
        ``steps_done``: the job's optimizer steps so far (a resume's step included);
        ``paused``: told the seconds a window's own work took after a step (a trace
        written), which the step clock and the samples/s figure leave out."""
        self._rank, self._device, self._timeout_s = rank, device, timeout_s
        self._run_dir, self._run_id = run_dir, run_id
        self._steps_done, self._say, self._paused = steps_done, say, paused
        self.window: ProfileWindow | None = None

    def profile(self, steps: range, *, dir: str | Path | None = None) -> ProfileWindow:
        """Run torch.profiler on every rank for training ``steps`` only (see the module).

        Call it at the same step on every rank, before the window (usually
        before the loop); its end is a collective. Use it as a ``with`` block
        around the loop so a loop that stops early still writes its trace.
        ``dir``: where every rank writes (default ``<run_dir>/<run id>/profile``, the
        config's ``run_dir`` or ``./runs``; the run id is the trackers' when the job
        logs (``log_with``), else torchrun's, else the main rank's
        ``local-<date>-<time>-<pid>``).
        """
        if self.window is not None and self.window.active:
            raise UsageError(f"a profile of steps {self.window.steps!r} is still running: "
                             "profile one window at a time")  # fmt: skip
        done = self._steps_done()
        steps = check_steps(steps, done)
        env = envmod.current()
        directory = Path(dir) if dir is not None else self._default_dir(env)
        if directory.exists() and not directory.is_dir():
            raise UsageError(f"profile(dir={str(directory)!r}) is a file: give a directory")
        self.window = ProfileWindow(
            steps, directory, done=done, rank=self._rank,
            host=envmod.host_name(env), device=self._device,
            timeout_s=self._timeout_s, say=self._say, paused=self._paused,
        )  # fmt: skip
        return self.window

    def after_step(self, step: int) -> None:
        """The step event's listener: an open window advances with the job's steps."""
        if self.window is not None:
            self.window.after_step()

    def _default_dir(self, env: envmod.Environ) -> Path:
        """Beside the trackers' records when the job logs (their run id, the main
        rank's); else torchrun's id; else the main rank's name (one broadcast)."""
        if self._run_id is not None:
            run = self._run_id()
        else:
            run = torchrun_id(env) or local_name(time.time(), os.getpid())
        if self._run_id is not None or not torchrun_id(env):
            run = broadcast_json(run, operation="profile directory", timeout_s=self._timeout_s)
        return default_dir(self._run_dir, str(run))

    def close(self) -> None:
        """``Parallel.close``: a window still open ends here, without the collective."""
        if self.window is not None:
            self.window.close()
