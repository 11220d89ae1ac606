"""The job's step across a Checkpointer resume, in one process: par.log's ``step=None``
and par.profile's window both continue from the checkpoint's training step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tracking_read as read
from torch import nn

from manygpu import Parallel
from manygpu.checkpoint import Checkpointer
from manygpu.checkpoint.manager import TrainState


def _train(root: Path, until: int, *, log_first: bool) -> str:
    """Steps up to ``until``, a checkpoint every 5, each step's loss = its number;
    the job then "dies" (closes without saving): steps after the checkpoint were logged."""
    with Parallel(log_with="jsonl", run_dir=str(root / "runs")) as par:
        model = par.prepare(nn.Linear(2, 1))
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        ckpt = Checkpointer(par, root / "ck", model=model, optimizer=opt, every=5,
                            handle_signals=False)  # fmt: skip
        step = ckpt.resume().step
        while step < until:
            step += 1
            par.backward(model(torch.ones(1, 2)).sum())
            opt.step()
            opt.zero_grad()
            if log_first:
                par.log({"loss": float(step)})
            ckpt.after_step(TrainState(step=step))
            if not log_first:
                par.log({"loss": float(step)})
        ckpt.close()
        return str(par.job_state.tracking()["run_id"])  # type: ignore[index]


@pytest.mark.parametrize("log_first", [True, False], ids=["log-then-save", "save-then-log"])
def test_step_none_is_the_training_step_in_either_order_across_a_resume(
    tmp_path: Path, log_first: bool
) -> None:
    first = _train(tmp_path, 7, log_first=log_first)  # checkpoint at 5, 6 and 7 logged
    again = _train(tmp_path, 10, log_first=log_first)
    assert again == first
    lines = read.jsonl(tmp_path / "runs" / first / "metrics.jsonl")
    got = [(x["step"], x["values"]["loss"]) for x in lines if "step" in x]
    assert got == [(s, float(s)) for s in range(1, 11)]


def test_a_profile_window_counts_from_the_resumed_step(tmp_path: Path) -> None:
    _train(tmp_path, 5, log_first=True)  # checkpoint at step 5
    with Parallel(log_with="jsonl", run_dir=str(tmp_path / "runs")) as par:
        model = par.prepare(nn.Linear(2, 1))
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        ckpt = Checkpointer(par, tmp_path / "ck", model=model, optimizer=opt,
                            handle_signals=False)  # fmt: skip
        assert ckpt.resume().step == 5
        with pytest.raises(Exception, match="has done 5 steps already"):
            par.profile(steps=range(2, 4), dir=str(tmp_path / "p"))
        window = par.profile(steps=range(6, 8), dir=str(tmp_path / "p"))
        for _ in range(3):  # steps 6, 7 and 8 of the job
            par.backward(model(torch.ones(1, 2)).sum())
            opt.step()
            opt.zero_grad()
        assert not window.active and window.summary is not None
        ckpt.close()
