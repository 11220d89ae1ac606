"""manygpu demo on one worker: no speed-up of one worker over one worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jobs import subprocess_env


def test_one_worker_says_there_is_one_device(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "manygpu", "demo", "--workers", "1", "--epochs", "2",
           "--json", str(out)]  # fmt: skip
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
