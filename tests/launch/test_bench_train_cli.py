"""bench train for real, through the CLI: one then two worker processes, logged as JSONL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tracking_read as read
from jobs import subprocess_env


def test_real_run_one_then_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "results" / "train.json"
    runs = tmp_path / "results" / "runs"
    cmd = [sys.executable, "-m", "manygpu", "bench", "train", "--model", "demo-cnn",
           "--workers", "1,2", "--batch", "8", "--steps", "4", "--warmup", "1", "--block", "2",
           "--threads", "1", "--json", str(out),
           "--log-with", "jsonl", "--run-dir", str(runs)]  # fmt: skip
    # Started in tmp_path: the files go where --json says and nowhere else.
    env = subprocess_env() | {"CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    # Each job says what it does and when it is done, on stderr; stdout keeps the results.
    for job in ("job 1/2: demo-cnn on 1 worker(s)", "job 2/2: demo-cnn on 2 worker(s)"):
        assert f"manygpu bench train: {job}" in res.stderr and job not in res.stdout
    assert "manygpu bench train: job 2/2 done in" in res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["results"]
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "runs", "train.json", "train.md", "train.png"
    ]  # fmt: skip
    _check_runs(runs)
    data = json.loads(out.read_text())
    one, two = data["rows"]
    assert (one["workers"], two["workers"]) == (1, 2)
    for row in (one, two):
        assert row["samples_per_s"] > 0 and row["precision"] == "fp32"
        assert row["flops_per_step"] > 0 and row["mfu"] is None
        assert row["compute_s"] > 0 and row["comm_s"] >= 0 and row["data_s"] >= 0
        # The parts add up to the step they split (compute is capped at step - data).
        parts = row["compute_s"] + row["comm_s"] + row["data_s"]
        assert parts == pytest.approx(row["step_s"], rel=1e-9)
    assert one["nosync_compute_s"] is None and two["nosync_compute_s"] > 0
    # Per-worker scaling: the same CPU threads per worker at every count.
    assert one["threads_per_worker"] == two["threads_per_worker"] == 1
    # The launcher's thread line names the count the workers keep (--threads).
    said = [w for line in res.stderr.splitlines() for w in line.split() if "OMP_NUM_THREADS=" in w]
    assert said and set(said) == {"OMP_NUM_THREADS=1"}, res.stderr
    assert one["comm_s"] == 0.0 and two["strategy"] == "ddp"
    speedup = two["samples_per_s"] / one["samples_per_s"]
    assert two["speedup"] == pytest.approx(speedup) and two["efficiency"] == pytest.approx(
        speedup / 2
    )
    table_rows = [
        ln for ln in out.with_suffix(".md").read_text().splitlines() if ln[:3] in ("| 1", "| 2")
    ]
    assert len(table_rows) == 2
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def _check_runs(runs: Path) -> None:
    """Each job is a run of its own: every timed normal step, with samples/s, no MFU on CPUs."""
    worlds = []
    for home in runs.iterdir():
        records = read.jsonl(home / "metrics.jsonl")
        worlds.append(records[0]["config"]["world_size"])
        steps = [r for r in records if "step" in r]
        assert [r["step"] for r in steps] == [1, 2, 3, 4]
        for r in steps:
            values = r["values"]
            assert values["samples_per_s"] > 0 and values["step_s"] > 0 and "mfu" not in values
            assert values["lr"] == 1e-4 and values["loss"] > 0
        # par.log's own figure, on the first step after each block of 2
        automatic = [r["values"].get("throughput/samples_per_s") for r in steps]
        assert automatic[0] > 0 and automatic[2] > 0, automatic
    assert sorted(worlds) == [1, 2]
