"""A resume on 2 gloo ranks of a checkpoint saved by 1 says so once, from the main rank.

Each rank captures its own standard output and warnings: exactly one line
in all of them, rank 0's, with the step, epoch, loader position and the
world-size change; no rank warns about that change.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

from ckpt_job import build, train
from dist_harness import run_ranks

from manygpu import Parallel


def _save_alone(directory: str) -> None:
    par = Parallel(strategy="ddp")  # a 1-rank group
    try:
        train(par, directory, 5, every=5)  # 5 steps x 4 samples: epoch 0, 20 read
    finally:
        par.close()


def _resume(directory: str) -> tuple[str, list[str], int]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        par = Parallel(strategy="ddp")
        try:
            *_, ckpt = build(par, directory, 0)
            step = ckpt.resume().step
            ckpt.close()
        finally:
            par.close()
    return out.getvalue(), [str(w.message) for w in seen], step


def test_one_rank_prints_the_resume_line(tmp_path: Path) -> None:
    directory = str(tmp_path / "ck")
    run_ranks(_save_alone, 1, directory, timeout=120)
    answers = run_ranks(_resume, 2, directory, timeout=120)
    assert [step for *_, step in answers] == [5, 5]
    printed = [
        (rank, line)
        for rank, (out, _, _) in enumerate(answers)
        for line in out.splitlines()
        if "resumed" in line
    ]
    # 20 samples read, 2 ranks x 4 per global batch: 2 batches each, 16 samples,
    # and the 4 that do not make a whole global batch are read again.
    assert printed == [
        (
            0,
            f"resumed {directory}/step-00000005: step 5, epoch 0, sample 16; world size 1 -> 2; "
            "4 samples of this epoch are read again (what was read does not split into whole "
            "global batches now)",
        )
    ]
    for _, messages, _ in answers:
        assert not [m for m in messages if "world size" in m], messages
