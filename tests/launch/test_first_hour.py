"""A new user's first mistakes under ``manygpu launch``, each answered in one line.

Real launches of 2 workers (tests/launch/scripts/first_hour.py and neighbours).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_launch import ROOT, SCRIPTS, manygpu

from manygpu.runtime.device import cpu_count

ENV = {"PYTHONPATH": str(ROOT / "src")}


def _ours(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("manygpu:")]


def test_a_typo_in_the_strategy_is_one_line_for_the_whole_job() -> None:
    res = manygpu(
        "launch", "--nproc-per-node", "2", str(SCRIPTS / "first_hour.py"), "typo", env=ENV
    )
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3, res.stderr
    assert _ours(res.stderr) == [
        "manygpu: ranks 0, 1: unknown strategy 'fdsp'; did you mean 'fsdp'? choose one of: "
        "auto, ddp, dp, ep, fsdp, hybrid, model, parallelize, pipeline, ps, single, tensor, "
        "zero1, zero2"
    ], res.stderr


def test_a_typo_in_a_plain_python_run_is_one_line_too() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | ENV
    script = [sys.executable, str(SCRIPTS / "first_hour.py"), "typo"]
    res = subprocess.run(script, capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 1
    assert res.stderr.startswith("manygpu: unknown strategy 'fdsp'; did you mean 'fsdp'?")
    assert len(res.stderr.splitlines()) == 1, res.stderr


def test_the_traceback_of_a_configuration_error_is_there_on_request() -> None:
    env = ENV | {"MANYGPU_TRACEBACK": "1"}
    res = manygpu(
        "launch", "--nproc-per-node", "2", str(SCRIPTS / "first_hour.py"), "typo", env=env
    )
    assert res.stderr.count("Traceback (most recent call last)") == 2, res.stderr


def test_workers_that_never_form_a_group_are_told_so_once() -> None:
    res = manygpu(
        "launch", "--nproc-per-node", "2", str(SCRIPTS / "first_hour.py"), "alone", env=ENV
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("trained on its own") == 2
    assert _ours(res.stderr) == [
        "manygpu: the 2 workers never formed a process group: each ran the whole script "
        "alone (same data, same output files); create a Parallel(...) or call "
        "torch.distributed.init_process_group() in the script"
    ], res.stderr


def test_ctrl_c_without_a_checkpointer_is_one_line_after_accelerate_and_horovodrun_flags(
    tmp_path: Path,
) -> None:
    """Ctrl-C is one line, and before it the flags from accelerate and horovodrun took
    effect (one job serves both): --nproc-per-node auto, --strategy/--precision as
    Parallel()'s defaults, --network-interface, and --output-filename's per-rank files."""
    logs = tmp_path / "logs"
    # auto is this machine's CPUs: capped here, so a big machine does not start dozens
    auto = 2 <= cpu_count() <= 4
    workers = cpu_count() if auto else 2
    cmd = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", "auto" if auto else "2"]
    cmd += ["--strategy", "fsdp", "--precision", "bf16"]
    cmd += ["--network-interface", "lo", "--output-filename", str(logs)]
    cmd += [str(SCRIPTS / "first_hour.py"), "wait", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | ENV
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("started*"))) < workers:
            assert time.monotonic() < deadline and job.poll() is None, "the workers never started"
            time.sleep(0.2)
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()  # no-op once it ended; a failed test leaves no launcher behind
    assert job.returncode == 128 + signal.SIGINT, err
    assert _ours(err) == [f"manygpu: interrupted; stopped {workers} workers"], err
    assert "Traceback" not in err and "death signal" not in err, err
    said = sorted(ln.split(":", 1)[1] for ln in out.splitlines() if "rank " in ln)
    assert said == [f"rank {r}: fsdp bf16 lo" for r in range(workers)], out
    stdout_files = sorted(logs.rglob("stdout.log"))
    assert len(stdout_files) == workers, list(logs.rglob("*"))
    assert "fsdp bf16 lo" in stdout_files[0].read_text()
