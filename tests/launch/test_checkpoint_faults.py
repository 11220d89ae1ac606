"""Real faults under ``manygpu launch``: kill -9 of a worker, and SIGTERM (preemption)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from jobs import subprocess_env

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
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )


def test_kill_9_restarts_and_ends_bit_identical(tmp_path: Path) -> None:
    ref = _launch(tmp_path / "ref", tmp_path / "ref-ck", total=20, every=0)
    _, err = ref.communicate(timeout=120)
    assert ref.returncode == 0, err
    ref_losses = json.loads((tmp_path / "ref" / "losses-0.json").read_text())
    # Rank 1 SIGKILLs itself after step 11 (saved at 8); the agent restarts both.
    run = _launch(tmp_path / "run", tmp_path / "ck", total=20, every=4, kill_at=11, restarts=1)
    _, err = run.communicate(timeout=180)
    assert run.returncode == 0, err
    resumed = json.loads((tmp_path / "run" / "losses-1.json").read_text())
    assert min(int(s) for s in resumed) == 9  # continued after the step-8 checkpoint
    assert all(resumed[s] == ref_losses[s] for s in resumed)
    assert torch.equal(
        torch.load(tmp_path / "run" / "params.pt"), torch.load(tmp_path / "ref" / "params.pt")
    )


def test_sigterm_saves_and_exits_cleanly(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "run", tmp_path / "ck"
    job = _launch(out, ckpt, total=100_000, every=0, sleep_s=0.05)
    deadline = time.monotonic() + 60
    while not (out / "started").exists():
        assert time.monotonic() < deadline and job.poll() is None, job.stderr
        time.sleep(0.2)
    time.sleep(0.5)
    for pid_file in out.glob("pid*"):  # as Slurm does: every task gets the signal
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    steps = sorted(p.name for p in ckpt.iterdir())
    assert len(steps) == 1 and steps[0].startswith("step-")
    meta = inspect(ckpt)  # what `manygpu checkpoint inspect --json` prints (test_checkpoint_cli)
    assert meta["status"] == "ok" and 0 < meta["step"] < 100_000 and meta["world_size"] == 2
