"""``manygpu launch --ps 1`` for real: kill -9 of a worker (async goes on, sync ends naming
it) and of a server (one line naming it, no hang, no orphans)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import subprocess_env
from test_launch import assert_gone

SCRIPT = Path(__file__).parent / "scripts" / "ps_job.py"


def _launch(out: Path, mode: str, steps: int, ranks: int = 3) -> subprocess.Popen[str]:
    """One server (rank 0) and ``ranks - 1`` workers."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "manygpu", "launch", "--ps", "1", "--nproc-per-node", str(ranks),
           "--timeout", "30", str(SCRIPT), str(out), mode, str(steps)]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )


def _kill_when_started(
    job: subprocess.Popen[str], out: Path, victim: int, workers: tuple[int, ...] = (1, 2)
) -> None:
    """SIGKILL rank ``victim`` once every worker has trained a few steps."""
    deadline = time.monotonic() + 120
    while not all((out / f"started{r}").exists() for r in workers):
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.2)
    os.kill(int((out / f"pid{victim}").read_text()), signal.SIGKILL)


def _summary(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("manygpu:")]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_killed_worker_is_dropped_in_async_and_named_in_sync(tmp_path: Path, mode: str) -> None:
    out = tmp_path / mode
    job = _launch(out, mode, steps=80)
    _kill_when_started(job, out, victim=2)
    _, err = job.communicate(timeout=180)
    if mode == "async":
        assert job.returncode == 0, err
        assert (out / "done1").read_text() == "80"  # the other worker finished its steps
        assert "parameter server rank 0: worker rank 2 is gone" in err
        assert "goes on with 1 worker(s)" in err
    else:
        assert job.returncode == 1, err
        first = _summary(err)[0]
        assert first.startswith("manygpu: rank 0 failed with exit code 1: ParameterServerError")
        assert "worker rank 2 is gone" in first and "synchronous step" in first
        assert not (out / "done1").exists()
    assert_gone(out)


def test_a_killed_server_ends_the_job_in_one_line(tmp_path: Path) -> None:
    """One worker: how a worker takes its server's loss needs no second one."""
    out = tmp_path / "server"
    job = _launch(out, "async", steps=400, ranks=2)
    _kill_when_started(job, out, victim=0, workers=(1,))
    killed = time.monotonic()
    _, err = job.communicate(timeout=120)
    assert time.monotonic() - killed < 60  # no hang: well within the 30 s link timeout x 2
    assert job.returncode == 137, err
    lines = _summary(err)
    assert lines[0].startswith("manygpu: rank 0 was killed by SIGKILL"), lines
    assert lines[1:] and all("then (a consequence)" in ln for ln in lines[1:]), lines
    assert not (out / "done1").exists()
    assert_gone(out)
