"""Real faults under ``manygpu launch``: kill -9 of a worker, notices (preemption), Ctrl-C.

A job killed once serves a notice too: after its restarted run has ended, it
trains a new run that the notice stops (each launch costs a launcher and two
workers; a notice and a kill need not have jobs of their own).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_job import train, write_weights
from dist_harness import run_ranks
from jobs import subprocess_env

from manygpu import Parallel
from manygpu.checkpoint.export import inspect

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_launch.py"


def _launch(
    out: Path,
    ckpt: Path,
    total: int,
    every: int,
    kill_at: int = -1,
    sleep_s: float = 0.0,
    restarts: int = 0,
    extra_env: dict[str, str] | None = None,
    notice_ckpt: Path | None = None,
) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "manygpu",
        "launch",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        str(SCRIPT),
        str(ckpt),
        str(out),
        str(total),
        str(every),
        str(kill_at),
        str(sleep_s),
        *([str(notice_ckpt)] if notice_ckpt else []),
    ]
    # One thread per worker, as the reference's harness ranks have: same arithmetic.
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"} | (extra_env or {})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _uninterrupted(
    ckpt: str, total: int, strategy: str = "ddp", weights: str | None = None
) -> tuple[dict[int, float], torch.Tensor]:
    """What ckpt_launch.py runs on each worker, never killed and never saving."""
    with Parallel(strategy=strategy, timeout_s=30) as par:
        return train(par, ckpt, total, 0, weights=weights)


def _wait_for_training(job: subprocess.Popen[str], out: Path, limit_s: float = 60) -> None:
    """Until rank 0 has trained a step of the run that a notice is to stop, and a little more."""
    deadline = time.monotonic() + limit_s
    while not (out / "started").exists():
        assert time.monotonic() < deadline and job.poll() is None, "training never started"
        time.sleep(0.2)
    time.sleep(0.5)


def _check_notice(said: str, signum: int, ckpt: Path) -> None:
    """One save on the notice, named in a line, a checkpoint of the two ranks."""
    assert f"manygpu: {signal.Signals(signum).name}: saved step" in said, said
    steps = sorted(p.name for p in ckpt.iterdir())
    assert len(steps) == 1 and steps[0].startswith("step-")
    meta = inspect(ckpt)  # what `manygpu checkpoint inspect --json` prints (test_checkpoint_cli)
    assert meta["status"] == "ok" and 0 < meta["step"] < 100_000 and meta["world_size"] == 2


@pytest.mark.parametrize(
    ("empty", "signum", "to"),
    [(False, signal.SIGTERM, "workers"), (True, signal.SIGUSR1, "launcher")],
    ids=[
        "ddp-then-sigterm-to-every-worker",
        "fsdp-init-module-weights-then-sigusr1-to-the-launcher",
    ],
)
def test_kill_9_restarts_bit_identical_then_a_notice_saves_and_exits_cleanly(
    tmp_path: Path, empty: bool, signum: int, to: str
) -> None:
    """One job: a worker killed (-9) and the restarted job ending bit-identical; then,
    in the same attempt, a new run that a notice stops with a save and exit code 0.

    The notice is SIGTERM to every worker (as Slurm's preemption and Kubernetes do),
    or SIGUSR1 to the launcher only (``srun manygpu launch`` with ``--signal=USR1@N``:
    the launchers are Slurm's tasks, and pass it on)."""
    # fsdp-init-module-weights: the model built empty and read from a file into
    # each rank's shards; the resume must still win over the file, exactly.
    strategy, weights = (
        ("fsdp", write_weights(tmp_path / "w.safetensors")) if empty else ("ddp", None)
    )
    extra = {"CKPT_STRATEGY": strategy, "CKPT_WEIGHTS": weights} if weights else {}
    # The reference, on two gloo ranks forked by the test harness: the launcher
    # itself is what the run below tests.
    ref_losses, ref_params = run_ranks(
        _uninterrupted, 2, str(tmp_path / "ref-ck"), 20, strategy, weights
    )[0]
    # Rank 1 SIGKILLs itself after step 11 (saved at 8); the agent restarts both.
    out, notice_ckpt = tmp_path / "run", tmp_path / "notice-ck"
    run = _launch(
        out, tmp_path / "ck", total=20, every=4, kill_at=11, sleep_s=0.05, restarts=1,
        extra_env=extra, notice_ckpt=notice_ckpt,
    )  # fmt: skip
    try:
        _wait_for_training(run, out, limit_s=180)  # after a kill and a restart
        pids = [int(p.read_text()) for p in out.glob("pid*")] if to == "workers" else [run.pid]
        for pid in pids:
            os.kill(pid, signum)
        said, err = run.communicate(timeout=180)
    finally:
        run.kill()  # no-op once it ended; a failed test leaves no launcher behind
    assert run.returncode == 0, err
    # The restart said in one line (the rank, how it died, which restart); rank 0's lost
    # collective is no traceback of the backend's.
    restarts = [ln for ln in err.splitlines() if "restarting" in ln]
    assert len(restarts) == 1, err
    assert restarts[0].startswith("manygpu: rank 1 was killed by SIGKILL (pid "), err
    assert restarts[0].endswith("; restarting every worker (restart 1 of 1)"), err
    assert "Traceback" not in err and "GLHF" not in err, err
    resumed = json.loads((out / "losses-1.json").read_text())
    assert min(int(s) for s in resumed) == 9  # continued after the step-8 checkpoint
    assert all(resumed[s] == ref_losses[int(s)] for s in resumed)
    assert torch.equal(torch.load(out / "params.pt"), ref_params)
    _check_notice(said + err, signum, notice_ckpt)


def test_ctrl_c_saves_once_and_says_so_in_one_line(tmp_path: Path) -> None:
    """Ctrl-C at the launcher (the terminal's SIGINT reaches it; it passes SIGINT on):
    the Checkpointer saves as on SIGTERM, and the launcher's one line replaces
    torch's death-signal warning and every rank's KeyboardInterrupt traceback."""
    out, ckpt = tmp_path / "run", tmp_path / "ck"
    job = _launch(out, ckpt, total=100_000, every=0, sleep_s=0.05)
    try:
        _wait_for_training(job, out)
        job.send_signal(signal.SIGINT)
        said, err = job.communicate(timeout=60)
    finally:
        job.kill()  # no-op once it ended; a failed test leaves no launcher behind
    assert job.returncode == 128 + signal.SIGINT, err
    assert "manygpu: SIGINT: saved step" in said + err, said + err
    assert err.strip().splitlines()[-1] == "manygpu: interrupted; stopped 2 workers", err
    assert "Traceback" not in err and "death signal" not in err, err
    assert len([p for p in ckpt.iterdir() if p.name.startswith("step-")]) == 1
