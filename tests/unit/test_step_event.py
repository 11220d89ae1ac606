"""The job's one step event: one counter, listeners in a fixed order, one owner.

What runs at each optimizer step (fp8's scales, the straggler clock, the
profiler's window) hangs on ``par.events``; these tests pin its contract: the
order does not depend on registration order, only the first prepared
optimizer counts the job's steps, a second optimizer still reaches the
listeners that ask for every update, and a resume continues the count.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from manygpu import Parallel
from manygpu.core.steps import ORDER, StepEvents
from manygpu.transforms.pipeline import Around, prepare_module


def test_listeners_run_in_the_fixed_order_whatever_order_they_were_added() -> None:
    events, seen = StepEvents(), []
    for name in reversed(ORDER):
        events.on_step(name, lambda step, n=name: seen.append((n, step)))
    events.stepped(first=True)
    assert seen == [(name, 1) for name in ORDER]


def test_only_the_first_optimizer_counts_and_every_optimizer_listeners_hear_both() -> None:
    events, heard = StepEvents(), {"fp8": 0, "clock": 0}
    events.on_step(
        "fp8", lambda _s: heard.__setitem__("fp8", heard["fp8"] + 1), every_optimizer=True
    )
    events.on_step("clock", lambda _s: heard.__setitem__("clock", heard["clock"] + 1))
    events.stepped(first=True)
    events.stepped(first=False)
    assert events.done == 1 and heard == {"fp8": 2, "clock": 1}


def test_before_step_listeners_see_the_step_about_to_happen() -> None:
    events, seen = StepEvents(), []
    events.before_step("grad_rescale", seen.append)
    events.stepping(first=True)
    events.stepped(first=True)
    events.stepping(first=False)  # a second optimizer's update is not a new training step
    assert seen == [1]


def test_a_listener_without_a_place_or_registered_twice_is_refused() -> None:
    events = StepEvents()
    with pytest.raises(ValueError, match="no place"):
        events.on_step("mystery", lambda _s: None)
    events.on_step("clock", lambda _s: None)
    with pytest.raises(ValueError, match="already registered"):
        events.on_step("clock", lambda _s: None)


def test_resume_continues_the_count_and_the_loops_step_leads_when_ahead() -> None:
    events = StepEvents()
    assert events.job_step is None
    events.resume(7)
    events.stepped(first=True)
    assert (events.done, events.job_step) == (8, 8)
    events.note(20)  # the loop counts its own way (e.g. micro-steps): the larger wins
    assert events.job_step == 20


def test_prepared_optimizers_fire_the_jobs_event_once_per_update() -> None:
    with Parallel(strategy="single", grad_accum_steps=2) as par:
        a, b = nn.Linear(3, 3), nn.Linear(3, 1)
        model = par.prepare(nn.Sequential(a, b))
        opt1 = par.prepare(torch.optim.SGD(a.parameters(), lr=0.1))
        opt2 = par.prepare(torch.optim.SGD(b.parameters(), lr=0.1))
        seen: list[int] = []
        par.events.on_step("clock", seen.append)  # one process: no straggler clock of its own
        for _ in range(4):  # two accumulation cycles of two micro-steps
            par.backward(model(torch.randn(2, 3)).sum())
            opt1.step()
            opt2.step()
        assert (par.events.done, seen) == (2, [1, 2])
        assert par.job_state.step == 2


def test_the_pipeline_runs_its_steps_in_the_written_order() -> None:
    calls: list[str] = []

    class Named:
        def __init__(self, name: str) -> None:
            self._name = name

        @property
        def name(self) -> str:
            return self._name

        def convert(self, model: nn.Module) -> str | None:
            calls.append(self._name)
            return f"{self._name} done"

    def shard(model: nn.Module) -> nn.Module:
        calls.append("shard")
        return nn.Sequential(model)

    around = Around(
        sync_weights=lambda _m: calls.append("sync"),
        remember=lambda _m: calls.append("remember"),
        shard=shard,
        fill=lambda _m: calls.append("fill"),
        hook=lambda _m: calls.append("hook"),
        compile=lambda _m: calls.append("compile"),
    )
    said: list[str] = []
    wrapped = prepare_module(nn.Linear(2, 2), [Named("layout"), Named("ckpt")], around, said.append)
    assert isinstance(wrapped, nn.Sequential)
    assert calls == ["sync", "remember", "layout", "ckpt", "shard", "fill", "hook", "compile"]
    assert said == ["layout done", "ckpt done"]
