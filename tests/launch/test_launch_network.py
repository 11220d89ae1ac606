"""What a launched job exposes on the network, and what a non-member can do to it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from jobs import subprocess_env
from rdzv_attack import attack

SCRIPTS = Path(__file__).parent / "scripts"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "manygpu", "launch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


def _listening(root: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP listener of ``root``'s process tree."""
    tree = psutil.Process(root)
    pids = {root} | {p.pid for p in tree.children(recursive=True)}
    return [
        (c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name())
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early:\n{proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared")
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_single_node_job_listens_on_loopback_only(tmp_path: Path) -> None:
    proc = _start("--nproc-per-node", "2", str(SCRIPTS / "wait_for_go.py"), str(tmp_path))
    try:
        _wait_for(tmp_path / "ready1", proc)
        _wait_for(tmp_path / "ready0", proc)
        listeners = _listening(proc.pid)
        (tmp_path / "go").touch()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    # The rendezvous store and the workers' bootstrap store at least, all on loopback.
    assert len(listeners) >= 2, listeners
    exposed = [entry for entry in listeners if entry[0] not in LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"


@pytest.mark.timeout(120)
def test_a_non_member_writing_the_store_runs_no_code(tmp_path: Path) -> None:
    """A waiting multi-node job whose store gets a pickle ends in one line; no code runs."""
    marker = tmp_path / "attacker-ran"
    port = _free_port()
    proc = _start(
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "known",
        "--nproc-per-node",
        "1",
        "--timeout",
        "60",
        str(SCRIPTS / "wait_for_go.py"),
        str(tmp_path),
    )
    try:
        _wait_for_port(port, proc)
        attack("127.0.0.1", port, "known", str(marker))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert not marker.exists(), "the launcher ran code it read from the store"
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.startswith("manygpu:")]
    assert len(lines) == 1 and "not manygpu's" in lines[0], err
    assert "Traceback" not in err


def _wait_for_port(port: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not any(entry[1] == port for entry in _listening(proc.pid)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the store never listened on {port}: {proc.communicate()[1]}")
        time.sleep(0.1)
    time.sleep(1.0)  # the agent has written its first state by now


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
