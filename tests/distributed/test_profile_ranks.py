"""par.profile on two real gloo ranks, one of them slow on purpose (one spawned job).

Rank 1 sleeps inside every step, before its backward: under DDP rank 0 then
reaches the gradient all-reduce first and waits there. The summary must say
so — rank 1 the slowest in compute, rank 0 the longest in communication, each
with its host — and each rank's trace must hold the window's steps only. The
summary's exchange unpickles nothing: pickle's loaders raise in the ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import socket
import time
from pathlib import Path
from typing import Any

import torch
from dist_harness import run_ranks
from reference import make_data, make_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manygpu import Parallel
from manygpu.runtime import env as envmod

WINDOW = range(2, 4)
STEPS = 5
SLOW_S = 0.06
PHASES = ("compute", "comm")


def _refuse(*_: object, **__: object) -> Any:
    raise AssertionError("something unpickled data sent by another rank")


def _job(directory: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), Parallel(strategy="ddp", stragglers=False) as par:
        torch.distributed.distributed_c10d._tensor_to_object = _refuse  # type: ignore[assignment]
        pickle.loads = _refuse  # type: ignore[assignment]
        model = make_model()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = make_data(8 * STEPS)
        loader = par.prepare_loader(DataLoader(TensorDataset(x, y), batch_size=4))
        window = par.profile(steps=WINDOW, dir=directory)
        for step, (xb, yb) in enumerate(loader):
            with torch.profiler.record_function(f"user_step_{step}"):
                loss = nn.functional.mse_loss(model(xb), yb)
                if par.rank == 1:
                    time.sleep(SLOW_S)  # the slow rank: compute the others wait for
                par.backward(loss)
                opt.step()
                opt.zero_grad()
        default = par.profiler._default_dir(envmod.current())  # no torchrun run id: one broadcast
    assert window.summary is not None and window.trace is not None
    events = json.loads(Path(window.trace).read_text())["traceEvents"]
    return {
        "trace": window.trace.name,
        "marks": sorted({e["name"] for e in events if e.get("name", "").startswith("user_")}),
        "slowest": {
            p: getattr(window.summary.slowest(p), "rank", None) for p in ("compute", "comm")
        },
        "stdout": out.getvalue(),
        "default": str(default),
    }


def test_traces_per_rank_and_a_summary_that_names_the_slow_rank(tmp_path: Path) -> None:
    ranks = run_ranks(_job, 2, str(tmp_path))
    host = socket.gethostname()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"trace-rank0-{host}.json",
        f"trace-rank1-{host}.json",
    ]
    for rank, got in enumerate(ranks):
        assert got["trace"] == f"trace-rank{rank}-{host}.json"
        assert got["marks"] == [f"user_step_{s}" for s in WINDOW]  # no step outside the window
        assert got["slowest"] == {"compute": 1, "comm": 0}  # every rank has the summary
    # Without dir= and torchrun's id: one directory for every rank, unique to this run.
    default = Path(ranks[0]["default"])
    assert ranks[1]["default"] == str(default) and default.name == "profile"
    assert default.parent.name.startswith("local-") and default.parent.name != "local"
    printed = ranks[0]["stdout"]
    assert f"compute: rank 1 ({host})" in printed
    assert f"comm: rank 0 ({host})" in printed
    assert "profile of steps 2..3 on 2 rank(s)" in printed
    assert "profile of steps" not in ranks[1]["stdout"]  # printed once, by the main rank
