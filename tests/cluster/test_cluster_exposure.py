"""On emulated hosts: a multi-node job listens on its own address only, and a host
that is not part of it can reach its store yet cannot make it run code."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import subprocess_env

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

ROOT = Path(__file__).resolve().parents[2]
WAIT = ROOT / "tests" / "launch" / "scripts" / "wait_for_go.py"
ATTACK = ROOT / "tests" / "helpers" / "rdzv_attack.py"
PORT = 29593


def _launch(cluster: EmulatedCluster, host: int, out: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "manygpu", "launch", "--nnodes", "2", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", f"{cluster.addresses[0]}:{PORT}", "--nproc-per-node", "1"]
    argv += ["--timeout", "60", str(WAIT), str(out)]
    return cluster.popen(
        host,
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(namespace=True),
        start_new_session=True,
    )


def _listeners(cluster: EmulatedCluster, host: int) -> list[str]:
    res = subprocess.run(
        cluster.command(host, ["ss", "-ltnH"]), capture_output=True, text=True, check=True
    )
    return [line.split()[3] for line in res.stdout.splitlines()]


def _wait_for(paths: list[Path], procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 90
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"a node ended early:\n{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.2)


def _wait_listening(
    cluster: EmulatedCluster, host: int, addr: str, proc: subprocess.Popen[str]
) -> None:
    """Until ``host`` listens on ``addr`` (the launcher's store is up)."""
    deadline = time.monotonic() + 90
    while addr not in _listeners(cluster, host):
        if proc.poll() is not None:
            raise AssertionError(f"the node ended early:\n{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"nothing listens on {addr}"
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(300)
def test_listeners_are_on_each_hosts_own_address(tmp_path: Path) -> None:
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        procs = [_launch(cluster, host, tmp_path) for host in range(2)]
        try:
            _wait_for([tmp_path / "ready0", tmp_path / "ready1"], procs)
            seen = {host: _listeners(cluster, host) for host in range(2)}
            (tmp_path / "go").touch()
            results = [proc.communicate(timeout=60) for proc in procs]
        finally:
            _stop(procs)
    for host, proc in enumerate(procs):
        assert proc.returncode == 0, results[host][1][-3000:]
        own = cluster.addresses[host]
        assert seen[host], f"host {host} listens on nothing"
        stray = [a for a in seen[host] if not a.startswith((f"{own}:", "127.0.0.1:"))]
        assert not stray, f"host {host} listens beyond {own}: {stray}"
    assert f"{cluster.addresses[0]}:{PORT}" in seen[0]


@pytest.mark.timeout(300)
def test_a_host_outside_the_job_runs_no_code_in_it(tmp_path: Path) -> None:
    marker = tmp_path / "attacker-ran"
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        node = _launch(cluster, 0, tmp_path)  # waits for a second node that never comes
        try:
            _wait_listening(cluster, 0, f"{cluster.addresses[0]}:{PORT}", node)
            attack = subprocess.run(
                cluster.command(
                    1,
                    [
                        sys.executable,
                        str(ATTACK),
                        cluster.addresses[0],
                        str(PORT),
                        "agreed",
                        str(marker),
                    ],
                ),
                capture_output=True,
                text=True,
                timeout=60,
                env=subprocess_env(namespace=True),
            )
            _, err = node.communicate(timeout=90)
        finally:
            _stop([node])
    assert attack.returncode == 0, attack.stderr
    assert not marker.exists(), "the launcher ran code a non-member wrote"
    lines = [line for line in err.splitlines() if line.startswith("manygpu:")]
    assert node.returncode == 1 and len(lines) == 1 and "not manygpu's" in lines[0], err
