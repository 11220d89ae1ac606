"""manygpu demo on one worker: no speed-up of one worker over one worker; --log-with jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tracking_read as read
from jobs import subprocess_env


def test_one_worker_says_there_is_one_device(tmp_path: Path) -> None:
    out, runs = tmp_path / "demo.json", tmp_path / "runs"
    cmd = [sys.executable, "-m", "manygpu", "demo", "--workers", "1", "--epochs", "2",
           "--json", str(out), "--log-with", "jsonl", "--run-dir", str(runs)]  # fmt: skip
    env = subprocess_env() | {"CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    stdout = " ".join(res.stdout.split())  # rich may wrap the long line
    assert "One device, so no speed-up to measure" in stdout
    assert "speed-up" not in stdout.replace("no speed-up to measure", "")
    result = json.loads(out.read_text())
    assert result["workers"] == 1 and result["samples_per_s"] > 0
    assert result["speedup"] is None and result["efficiency"] is None
    assert result["single_worker_samples_per_s"] is None
    # Every training step went to the run, with the samples/s par.log adds by itself.
    (home,) = runs.iterdir()
    assert f"manygpu: logging run {home.name}: jsonl in {runs}/{home.name}/" in stdout
    assert f"logged run {home.name}: jsonl in {runs}/{home.name}/" in stdout
    records = read.jsonl(home / "metrics.jsonl")
    assert records[0]["config"]["world_size"] == 1
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)) and len(steps) > 20
    for r in steps:
        values = r["values"]
        assert values["lr"] == 2e-3 and values["step_s"] > 0 and values["loss"] > 0
        assert values["throughput/samples_per_s"] > 0
