"""On emulated hosts: a multi-node job listens on its own address only, and a host
that is not part of it (no job secret) can reach its ports yet cannot join,
read its stores, or make it run code."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch
from jobs import subprocess_env
from reference import reference_train

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

ROOT = Path(__file__).resolve().parents[2]
WAIT = ROOT / "tests" / "launch" / "scripts" / "wait_for_go.py"
ATTACK = ROOT / "tests" / "helpers" / "rdzv_attack.py"
DDP = ROOT / "tests" / "cluster" / "scripts" / "ddp_equivalence.py"
PORT = 29593
STEPS, BATCH = 3, 8


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


def _stranger(cluster: EmulatedCluster, argv: list[str], **env: str) -> CompletedProcess[str]:
    """Run ``argv`` on the stranger's host (the last), without the job's secret."""
    base = subprocess_env(namespace=True)
    del base["MANYGPU_JOB_SECRET"]
    return subprocess.run(
        cluster.command(len(cluster.addresses) - 1, argv),
        capture_output=True,
        text=True,
        timeout=120,
        env=base | env,
    )


def _launch_ddp(cluster: EmulatedCluster, host: int, out: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "manygpu", "launch", "--nnodes", "2", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", f"{cluster.addresses[0]}:{PORT}", "--nproc-per-node", "1"]
    argv += ["--timeout", "120", str(DDP), str(out), str(STEPS), str(BATCH), "wait"]
    return cluster.popen(
        host,
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(namespace=True),
        start_new_session=True,
    )


def _own_ports(cluster: EmulatedCluster, host: int, pid: int) -> list[int]:
    """The ports process ``pid`` listens on at ``host``'s own address (its stores' gates)."""
    res = subprocess.run(
        cluster.command(host, ["ss", "-ltnpH"]), capture_output=True, text=True, check=True
    )
    own = f"{cluster.addresses[host]}:"
    return [
        int(line.split()[3].rsplit(":", 1)[1])
        for line in res.stdout.splitlines()
        if line.split()[3].startswith(own) and f"pid={pid}," in line
    ]


def _probe(cluster: EmulatedCluster, host: int, ports: list[int], marker: Path) -> list[dict]:
    argv = [sys.executable, str(ATTACK), "--probe", cluster.addresses[host]]
    res = _stranger(cluster, [*argv, ",".join(map(str, ports)), str(marker)])
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


@pytest.mark.timeout(420)
def test_a_stranger_on_the_network_cannot_join_read_or_run_code(tmp_path: Path) -> None:
    """Host 2 has a route to the job's ports but not its secret: it cannot take the
    open seat (with no secret, or a wrong one), cannot talk to either store (the
    rendezvous one, or the workers' bootstrap one it finds by scanning), so it
    lists no key and runs no code; the job it knocked on finishes equal to one
    process, and its launcher names the stranger's address."""
    marker = tmp_path / "stranger-ran"
    with EmulatedCluster(3, LinkShape(rate="1gbit")) as cluster:
        join = [sys.executable, "-m", "manygpu", "launch", "--nnodes", "2"]
        join += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addresses[0]}:{PORT}"]
        join += ["--nproc-per-node", "1", "--timeout", "20", str(WAIT), str(tmp_path)]
        nodes = [_launch_ddp(cluster, 0, tmp_path)]
        try:
            _wait_listening(cluster, 0, f"{cluster.addresses[0]}:{PORT}", nodes[0])
            # The stranger's three attempts at once: each is a Python start-up.
            with ThreadPoolExecutor(3) as pool:
                none = pool.submit(_stranger, cluster, join)
                wrong = pool.submit(_stranger, cluster, join, MANYGPU_JOB_SECRET="a-guess-" * 4)
                probed = pool.submit(_probe, cluster, 0, [PORT], marker)
                no_secret, wrong_secret, at_start = none.result(), wrong.result(), probed.result()
            nodes.append(_launch_ddp(cluster, 1, tmp_path))
            _wait_for([tmp_path / "ready0", tmp_path / "ready1"], nodes)
            ports = _own_ports(cluster, 0, nodes[0].pid)
            seen = {host: _listeners(cluster, host) for host in range(2)}
            running = _probe(cluster, 0, ports, marker)
            (tmp_path / "go").touch()
            results = [node.communicate(timeout=120) for node in nodes]
        finally:
            _stop(nodes)
    assert no_secret.returncode == 2, no_secret.stderr
    assert no_secret.stderr.count("manygpu") == 1 and "MANYGPU_JOB_SECRET" in no_secret.stderr
    assert wrong_secret.returncode != 0 and "refused this node's job secret" in wrong_secret.stderr
    assert len(ports) == 2, f"expected the two gates (rendezvous, bootstrap): {ports}"
    for host, listening in seen.items():  # the stores themselves sit on loopback
        own = cluster.addresses[host]
        stray = [a for a in listening if not a.startswith((f"{own}:", "127.0.0.1:"))]
        assert listening and not stray, f"host {host} listens beyond {own}: {stray}"
    assert f"{cluster.addresses[0]}:{PORT}" in seen[0]
    for attempt in [*at_start, *running]:
        assert not attempt["connected"] and not attempt["keys"], attempt
    assert not marker.exists(), "code a stranger wrote ran in the job"
    for node, (_, err) in zip(nodes, results, strict=True):
        assert node.returncode == 0, err[-3000:]
    stranger = cluster.addresses[2]
    assert f"refused a connection to the job's store from {stranger}:" in results[0][1]
    ref = reference_train(STEPS, BATCH)
    for rank in range(2):
        rec = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert rec["world"] == 2 and rec["node"] == rank
        assert (rec["params"] - ref).abs().max().item() < 1e-5
