"""``manygpu doctor`` for real: local report, JSON, exit codes, and every rank of a job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch

from manygpu.cli.main import main

CHECK_KEYS = {"name", "status", "message", "fix", "host"}


def manygpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env |= env or {}
    return subprocess.run(
        [sys.executable, "-m", "manygpu", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def test_local_doctor_json_with_live_test() -> None:
    res = manygpu("--json")
    report = json.loads(res.stdout)  # stdout is the JSON and nothing else
    assert res.returncode == (1 if report["status"] == "fail" else 0), res.stderr
    # What took the time was said, on stderr: the probes, then the live test.
    assert "manygpu doctor: probing this machine" in res.stderr
    assert "manygpu doctor: live test: starting the local workers" in res.stderr
    assert set(report) == {"status", "counts", "checks", "nodes", "live", "ray"}
    assert all(set(c) == CHECK_KEYS for c in report["checks"])
    assert all(c["status"] in ("ok", "warn", "fail") for c in report["checks"])
    assert all(c["fix"] for c in report["checks"] if c["status"] != "ok")
    (node,) = report["nodes"]
    assert node["system"]["hostname"] == socket.gethostname()
    assert node["torch"]["version"] == torch.__version__
    live = report["live"]
    expected_world = max(torch.cuda.device_count(), 2) if torch.cuda.is_available() else 2
    assert live["world_size"] == expected_world
    assert live["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
    assert live["all_reduce_error"] is None and live["all_reduce_ms"] > 0
    assert [(p["a"], p["b"]) for p in live["pairs"]] == [(0, 1)]
    assert live["pairs"][0]["gbps"] > 0 and live["pairs"][0]["error"] is None
    found = statuses(report)
    assert found["all_reduce"] == "ok" and found["links"] == "ok"
    if not torch.cuda.is_available():
        assert found["gpus"] == "warn"
        gpus = next(c for c in report["checks"] if c["name"] == "gpus")
        assert gpus["message"].startswith("no GPU on this machine")


def test_failing_check_exits_1_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuch0")
    assert main(["doctor", "--no-live"]) == 1
    out = capsys.readouterr().out
    assert "NCCL_SOCKET_IFNAME=nosuch0" in out and "does not exist" in out
    assert "FAIL" in out and "Checks" in out and "Machine" in out
    assert "Live test" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--p2p-bytes", "lots"], "'lots' is not a size"),
        (["--p2p-bytes", "2G"], "--p2p-bytes 2G is outside 4 bytes .. 1G"),
        (["--nnodes", "2"], "need --all-ranks"),
        (["--op-timeout", "0"], "must be greater than 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["doctor", "--no-live", *args])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and message in err, err


def test_all_ranks_on_gloo() -> None:
    res = manygpu("--all-ranks", "--nproc-per-node", "3", "--json", "--p2p-bytes", "1M")
    report = json.loads(res.stdout)
    assert res.returncode == (1 if report["status"] == "fail" else 0), res.stderr
    live = report["live"]
    assert live["world_size"] == 3 and live["nbytes"] == 1 << 20
    assert len(live["hosts"]) == 3
    assert [(p["a"], p["b"]) for p in live["pairs"]] == [(0, 1), (0, 2), (1, 2)]
    assert all(p["error"] is None and p["gbps"] > 0 for p in live["pairs"])
    found = statuses(report)
    assert found["consistency"] == "ok" and found["all_reduce"] == "ok"
    consistency = next(c for c in report["checks"] if c["name"] == "consistency")
    assert consistency["message"].startswith("3 ranks on 1 node(s)")
    assert len(report["nodes"]) == 1
