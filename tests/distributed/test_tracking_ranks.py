"""par.log at 2 real gloo ranks, every tracker at once; kill -9, then resume on 1 rank.

One spawned job for all four trackers: rank r logs ``step + r`` (mean), ``1``
(sum) and ``r`` (max). Rank 0 SIGKILLs itself after step 5 (the checkpoint holds
step 3), so steps 4 and 5 were logged by a job that died (and asked
``par.job_state.tracking()`` at step 5, as the demo does); one rank then resumes
and trains to step 8. Each tracker must show one run, the config once, steps
1..8 each once; steps 4 and 5 hold the resumed job's values except in MLflow,
which cannot replace them (W&B offline: the resumed half, see manygpu.tracking.wandb).
Before training, ranks that log different keys or bad ``reduce=`` on one rank
only must all raise the same line instead of waiting in the collective.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import tracking_read as read
from dist_harness import run_ranks
from torch import nn

from manygpu import Parallel
from manygpu.checkpoint import Checkpointer
from manygpu.checkpoint.manager import TrainState
from manygpu.errors import UsageError

TRACKERS = ["tensorboard", "mlflow", "wandb", "jsonl"]
ENV = {"MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _job(run_dir: str, ckpt_dir: str, total: int, kill_at: int) -> str:
    par = Parallel(strategy="ddp", log_with=TRACKERS, run_dir=run_dir, stragglers=False)
    try:
        model = par.prepare_model(nn.Linear(2, 1))
        ckpt = Checkpointer(par, ckpt_dir, model=model, every=3, handle_signals=False)
        step = ckpt.resume().step
        if kill_at > 0:
            _disagree(par, Path(run_dir).parent)
        while step < total:
            step += 1
            r = par.rank
            par.log({"loss": torch.tensor(step + r), "ranks": 1, "top": r},
                    reduce={"ranks": "sum", "top": "max"})  # fmt: skip
            ckpt.after_step(TrainState(step=step))
            if step == kill_at and par.rank == 0:
                par.job_state.tracking()  # outside a checkpoint: a resume must not trust it
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.close()
        return str((par.job_state.tracking() or {}).get("run_id"))
    finally:
        par.close()


def _disagree(par: Parallel, out: Path) -> None:
    """Two bad calls, each bad on rank 1 only; every rank writes the line it raised."""
    calls = [({"loss": 1.0} | ({"mfu": 0.5} if par.rank else {}), None),
             ({"loss": 1.0}, {"loss": "median" if par.rank else "mean"})]  # fmt: skip
    lines = []
    for values, reduce in calls:
        try:
            par.log(values, reduce=reduce, step=0)
        except UsageError as exc:
            lines.append(str(exc))
    (out / f"refused-rank{par.rank}.json").write_text(json.dumps(lines))


def test_one_run_means_over_ranks_and_a_resume_on_another_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs, ckpt = tmp_path / "runs", tmp_path / "ck"
    env = ENV | {"MLFLOW_TRACKING_URI": (runs / "mlruns").as_uri()}
    with pytest.raises(AssertionError, match="rank 0"):
        run_ranks(_job, 2, str(runs), str(ckpt), 8, 5, extra_env=env, timeout=240)
    (run_id,) = run_ranks(_job, 1, str(runs), str(ckpt), 8, -1, extra_env=env, timeout=240)
    refused = [json.loads((tmp_path / f"refused-rank{r}.json").read_text()) for r in (0, 1)]
    assert refused[0] == refused[1] and len(refused[0]) == 2  # the same lines on both ranks
    assert "rank(s) 1: loss, mfu" in refused[0][0]
    assert refused[0][1].startswith("rank 1: log(reduce={'loss': 'median'})")
    homes = [p for p in runs.iterdir() if p.name != "mlruns"]
    assert [p.name for p in homes] == [run_id]  # one run, the same id after the resume
    home = homes[0]
    expected = {s: (s + 0.5 if s <= 5 else float(s)) for s in range(1, 9)}
    resumed = {s: (s + 0.5 if s <= 3 else float(s)) for s in range(1, 9)}
    ranks = {s: (2.0 if s <= 3 else 1.0) for s in range(1, 9)}

    lines = read.jsonl(home / "metrics.jsonl")
    assert sum("config" in x for x in lines) == 1
    assert lines[0]["config"]["world_size"] == 2 and lines[0]["config"]["strategy"] == "ddp"
    got = [(x["step"], x["values"]["loss"], x["values"]["ranks"]) for x in lines if "step" in x]
    assert [s for s, _, _ in got] == list(range(1, 9))  # continuous, none twice
    # Steps 4 and 5 are the resumed rank's, as in TensorBoard: the dead job's are dropped.
    assert all(v == resumed[s] and n == ranks[s] for s, v, n in got)
    assert [x["values"]["top"] for x in lines if "step" in x][:3] == [1.0] * 3

    tb = read.tensorboard(home)
    steps = [s for s, _ in tb["scalars"]["loss"]]
    assert steps == list(range(1, 9))
    # Steps 4 and 5 are the resumed rank's (TensorBoard hides the killed job's after step 3).
    assert dict(tb["scalars"]["loss"]) == resumed
    assert tb["texts"] == {"manygpu/config/text_summary": 1}

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the reader's own store
    (ml,) = read.mlflow_runs(env["MLFLOW_TRACKING_URI"])
    assert ml["name"] == run_id and ml["params"]["world_size"] == "2"
    # MLflow cannot replace a value: steps 4 and 5 keep the dead job's 2-rank means.
    assert ml["metrics"]["loss"] == [(s, expected[s]) for s in range(1, 9)]

    # Offline, W&B writes a run's records when it finishes: the killed job's are lost.
    wb = [r for r in read.wandb_runs(home / "wandb") if r["id"] is not None]
    assert [r["id"] for r in wb] == [run_id]  # the resumed job continued the same run
    rows = wb[0]["history"]
    assert [row["_step"] for row in rows] == list(range(4, 9))  # after the checkpoint's step 3
    assert all(row["loss"] == float(row["_step"]) for row in rows)
