"""A worker that sends a parameter server a crafted header, on real gloo ranks.

The crafted header has the protocol's length and lies in its numbers (a state
of 10**12 bytes to load, a negative or NaN size, an unknown kind). It goes out
with torch.distributed's own ``ProcessGroupGloo.send`` over the pair's link,
as a rogue process holding a worker's rank would send it. The server must not
allocate what it names: in sync mode the job ends with one line naming the
worker's global rank; in async mode the server drops that worker, as it drops
a dead one, and the honest worker trains to the end.

Rank 0 is the server, rank 1 the honest (first) worker, rank 2 the rogue one
(for the initial-parameters message, which only the first worker sends, rank 1
is the rogue one).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import itertools
import math
import time
import zipfile
from typing import Any

import pytest
import torch
from dist_harness import preload, run_ranks
from torch import nn

from manygpu import PS, Parallel
from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import detect_cluster
from manygpu.strategies.ps.protocol import (
    GONE,
    INIT,
    LOAD,
    HyperLayout,
    Layout,
    ParameterServerError,
    to_bytes,
)
from manygpu.strategies.ps.server import ServingDone

preload("manygpu.strategies.ps.strategy")

STEPS = 6
HUGE = 10**12


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(par: Parallel) -> str:
    """The honest worker: ``STEPS`` steps, then on until the server reports the rogue gone.

    Stepping on makes "the others train on" hold whatever the timing: the server
    drops the rogue while this worker is still live. ``"done"`` or why it stopped.
    """
    model, opt = par.prepare(*_model_and_optimizer())
    deadline = time.monotonic() + 60
    try:
        for step in itertools.count():
            par.backward(model(torch.ones(3, 4)).square().sum())
            opt.step()
            opt.zero_grad()
            lags = par.strategy.stats.lags  # type: ignore[attr-defined]
            if step + 1 >= STEPS and (GONE in lags or time.monotonic() > deadline):
                break
    except RuntimeError as exc:  # the server ended the job
        return f"stopped: {exc}"
    return "done"


def _send(par: Parallel, header: torch.Tensor) -> None:
    """Send ``header`` to the server on this worker's link, through torch.distributed."""
    link = par.strategy.ps.links[0]  # type: ignore[attr-defined]
    link.group.send([header], 0, 0).wait(dt.timedelta(seconds=30))


def _wait_for_the_server_to_go(par: Parallel) -> None:
    """Wait (bounded) until the server's process is gone: its link breaks."""
    link = par.strategy.ps.links[0]  # type: ignore[attr-defined]
    with contextlib.suppress(RuntimeError):
        link.group.recv([torch.zeros(1, dtype=torch.float64)], 0, 0).wait(dt.timedelta(seconds=60))


def _payload(name: str) -> torch.Tensor:
    """A state to load whose header tells its true size, but whose content lies."""
    state: dict[str, Any] = {
        "params": torch.zeros(10),
        "state": {0: {"momentum_buffer": torch.zeros(2, 4)}},
        "groups": [{"lr": 0.1}],
    }
    if name == "params":
        state["params"] = torch.zeros(10**6)
    elif name == "index":
        state["state"] = {7: {"momentum_buffer": torch.zeros(2)}}
    elif name == "entry":
        state["state"] = {1: {"momentum_buffer": torch.zeros(10**5)}}
    elif name == "groups":
        state["groups"] = [{"lr": 0.1}] * 3
    data = to_bytes(state)
    if name == "deflated":  # the same archive, its entries compressed: sizes it names
        raw = io.BytesIO()
        with (
            zipfile.ZipFile(io.BytesIO(data.numpy().tobytes())) as src,
            zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as dst,
        ):
            for entry in src.infolist():
                dst.writestr(entry.filename, src.read(entry))
        data = torch.frombuffer(bytearray(raw.getvalue()), dtype=torch.uint8)
    return data


def _rogue(par: Parallel, kind: float, size: float | str) -> str:
    """A worker that prepares as usual, then sends one header with a lying size."""
    _, opt = par.prepare(*_model_and_optimizer())
    client = opt.optimizer.client  # type: ignore[attr-defined]  # the PSOptimizer's
    header = client.servers[0].layout.new_request()
    payload = _payload(size) if isinstance(size, str) else None
    header[0], header[1] = kind, size if payload is None else payload.numel()
    _send(par, header)
    if payload is not None:
        _send(par, payload)
    client.said_bye = True  # the server no longer listens to it: no goodbye
    _wait_for_the_server_to_go(par)
    return "sent"


def _rogue_first(par: Parallel, size: float) -> str:
    """The first worker, sending initial parameters of a lying size instead of prepare's."""
    model, opt = _model_and_optimizer()
    par.prepare(model)
    hypers = HyperLayout.of(opt.param_groups)
    layout = Layout(hypers, len(list(model.parameters())), par.strategy.ps.workers)  # type: ignore[attr-defined]
    header = layout.new_request()
    header[0], header[1] = INIT, size
    _send(par, header)
    _wait_for_the_server_to_go(par)
    return "sent"


def _job(mode: str, rogue_rank: int, kind: float, size: float | str) -> Any:
    """This rank's part: what the server recorded or said, or what a worker saw."""
    par = Parallel(strategy=PS(mode=mode), timeout_s=30)
    err = io.StringIO()
    try:
        if par.is_server:
            with contextlib.redirect_stderr(err):
                par.prepare(*_model_and_optimizer())
        if detect_cluster(envmod.current()).rank != rogue_rank:
            return _train(par)
        if kind == INIT:
            return _rogue_first(par, size)
        return _rogue(par, kind, size)
    except ServingDone as done:
        return {"record": done.record, "stderr": err.getvalue()}
    except ParameterServerError as exc:
        return {"error": str(exc), "stderr": err.getvalue()}
    finally:
        par.close()


# One job per spawn: a server process that ended is what closes its links to the
# workers (their waits end at once), as in a real job.
@pytest.mark.parametrize(
    "rogue, kind, size, said",
    [
        (2, LOAD, float(HUGE), "sent a state of 1,000,000,000,000 bytes to load; this server "
         "takes at most"),
        (2, LOAD, -5.0, "sent a state of -5 bytes to load"),
        (2, LOAD, math.nan, "sent a state of nan bytes to load"),
        (1, INIT, math.nan, "sent initial parameters of nan numbers; this server holds 10 "),
    ],
)  # fmt: skip
def test_a_lying_size_ends_a_sync_job_in_one_line_naming_the_worker(
    rogue: int, kind: float, size: float, said: str
) -> None:
    server, first, second = run_ranks(_job, 3, "sync", rogue, kind, size, timeout=120)
    error = server["error"]
    assert "\n" not in error, error
    assert error.startswith(f"parameter server rank 0: worker rank {rogue} {said}"), error
    assert error.endswith("so the job ends") or kind == INIT, error
    honest = first if rogue == 2 else second
    assert honest.startswith("stopped"), honest  # the job ended before any step completed


@pytest.mark.parametrize(
    "kind, size, said",
    [
        (LOAD, float(HUGE), "sent a state of 1,000,000,000,000 bytes to load"),
        (LOAD, math.nan, "sent a state of nan bytes to load"),
        (42.0, 0.0, "sent an unknown message (kind 42.0)"),
        (LOAD, "params", "sent torch.float32[1,000,000] parameters to load; this server holds "
         "torch.float32[10]"),
        (LOAD, "index", "sent optimizer state for parameter 7; this server holds parameters 0, 1"),
        (LOAD, "entry", "sent optimizer state for parameter 1 that is not a dict of numbers and "
         "tensors of at most its 2 elements"),
        (LOAD, "groups", "sent 3 param groups to load; the optimizer has 1"),
        (LOAD, "deflated", "sent a state that does not load (archive entry"),
    ],
)  # fmt: skip
def test_a_lying_worker_is_dropped_in_async_and_the_others_train_on(
    kind: float, size: float | str, said: str
) -> None:
    server, honest, rogue = run_ranks(_job, 3, "async", 2, kind, size, timeout=120)
    record, lines = server["record"], server["stderr"].splitlines()
    assert record.dropped == [2] and record.finished == [1], record
    assert len(record.updates) >= STEPS and {u.worker for u in record.updates} == {0}
    assert honest == "done" and rogue == "sent"
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"manygpu: parameter server rank 0: worker rank 2 {said}")
    assert lines[0].endswith("goes on with 1 worker(s)"), lines


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 2.5, float(HUGE)])
def test_sizes_outside_the_shard_are_refused_before_any_allocation(value: float) -> None:
    from manygpu.strategies.ps.protocol import count

    assert count(value, 1, 1000) is None
    assert count(7.0, 1, 1000) == 7
