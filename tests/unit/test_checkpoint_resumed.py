"""The line a successful resume prints, and the loader position it reports (one process).

The 2-rank run (only the main rank prints; a world-size change) is in
tests/distributed/test_checkpoint_resume_line.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from ckpt_job import build, train

from manygpu import Parallel
from manygpu.checkpoint.resumed import Position, Resumed, position


def test_position_keeps_the_global_samples_read() -> None:
    saved = {"epoch": 2, "batches": 5, "world": 2, "batch_size": 4}  # 40 samples read
    assert position(saved, world=2, batch=4) == Position(epoch=2, batches=5, sample=40, early=0)
    assert position(saved, world=4, batch=5) == Position(epoch=2, batches=2, sample=40, early=0)
    assert position(saved, world=3, batch=4) == Position(epoch=2, batches=3, sample=36, early=4)


def test_the_line_names_step_epoch_sample_and_a_changed_world() -> None:
    where = Position(epoch=2, batches=20, sample=480, early=0)
    same = Resumed(
        path=Path("ckpts/step-00000060"), step=60, epoch=2, saved_world=2, world=2, where=where
    )
    assert same.line() == "resumed ckpts/step-00000060: step 60, epoch 2, sample 480"
    grown = Resumed(
        path=Path("ckpts/step-00000060"), step=60, epoch=2, saved_world=2, world=3, where=where
    )
    assert grown.line() == (
        "resumed ckpts/step-00000060: step 60, epoch 2, sample 480; world size 2 -> 3"
    )
    bare = Resumed(path=Path("c/step-00000007"), step=7, epoch=0, saved_world=1, world=1)
    assert bare.line() == "resumed c/step-00000007: step 7, epoch 0"  # no loader: no sample
    ragged = Position(epoch=0, batches=3, sample=36, early=4)
    line = Resumed(path=Path("c"), step=5, epoch=0, saved_world=2, world=3, where=ragged).line()
    assert line.startswith("resumed c: step 5, epoch 0, sample 36; world size 2 -> 3; 4 samples")


def test_a_resume_prints_one_line_and_warns_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "ck"
    with Parallel(strategy="single") as par:
        train(par, directory, 5, every=5)  # 5 steps of 4 samples: epoch 0, 20 samples read
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old per-rank warning would raise here
        with Parallel(strategy="single") as par:
            *_, ckpt = build(par, directory, 0, batch=3)  # 20 is no multiple of 3
            state = ckpt.resume()
            ckpt.close()
    assert state.step == 5
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"resumed {directory}/step-00000005: step 5, epoch 0, sample 18; 2 samples of this "
        "epoch are read again (what was read does not split into whole global batches now)"
    )
    assert len(lines) == 1


def test_a_fresh_start_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Parallel(strategy="single") as par:
        *_, ckpt = build(par, tmp_path / "empty", 0)
        assert ckpt.resume().step == 0
        ckpt.close()
    assert "resumed" not in capsys.readouterr().out
