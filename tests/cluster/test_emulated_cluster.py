"""Real multi-node runs: hosts are network namespaces joined by a bridge.

Needs root and iproute2; skips with the reason elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from jobs import subprocess_env
from reference import reference_train

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPT = Path(__file__).parent / "scripts" / "ddp_equivalence.py"


def test_hosts_reach_each_other_and_are_torn_down() -> None:
    with EmulatedCluster(2, LinkShape(rate="500mbit")) as cluster:
        names = list(cluster.names)
        probe = [
            sys.executable,
            "-c",
            f"import socket; socket.create_connection(('{cluster.addresses[1]}', 9), 2)",
        ]
        res = subprocess.run(cluster.command(0, probe), capture_output=True, text=True)
        # Port 9 has no listener: "refused" proves the packet reached host 1.
        assert "Connection refused" in res.stderr, res.stderr
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)


def test_two_hosts_two_processes_match_single_process(tmp_path: Path) -> None:
    steps, batch = 4, 12
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        master = cluster.addresses[0]
        argv = [
            [
                sys.executable,
                "-m",
                "manygpu",
                "launch",
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--nproc-per-node",
                "2",
                "--master-addr",
                master,
                "--master-port",
                "29555",
                "--timeout",
                "60",
                str(SCRIPT),
                str(tmp_path),
                str(steps),
                str(batch),
            ]
            for i in range(2)
        ]
        results = cluster.run_all(argv, timeout=150, env=subprocess_env(namespace=True))
    for node, res in enumerate(results):
        assert res.returncode == 0, f"node {node}:\n{res.stderr[-3000:]}"
    ref = reference_train(steps, batch)
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for rank, rec in enumerate(records):
        assert rec["world"] == 4 and rec["node"] == rank // 2
        # The workers reach the store through their node's door on loopback; the
        # job met over the namespace network (node 1 holds ranks 2-3).
        assert rec["master_addr"] == "127.0.0.1"
        assert (rec["params"] - ref).abs().max().item() < 1e-5
        assert torch.equal(rec["params"], records[0]["params"])


def _netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_torn_down_on_error() -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), EmulatedCluster(2) as cluster:
        names = list(cluster.names)
        raise RuntimeError("boom")
    assert names and not any(n in _netns_names() for n in names)


def test_torn_down_on_sigterm() -> None:
    code = (
        "import sys, time\n"
        "from manygpu.emulate import EmulatedCluster\n"
        "with EmulatedCluster(2) as c:\n"
        "    print(' '.join(c.names), flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(namespace=True),
    )
    assert proc.stdout is not None
    names = proc.stdout.readline().split()
    assert len(names) == 2 and all(n in _netns_names() for n in names)
    proc.terminate()
    proc.wait(timeout=30)
    assert not any(n in _netns_names() for n in names)


def test_module_cli_runs_a_command_per_host() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "manygpu.emulate",
            "--hosts",
            "2",
            "--",
            "sh",
            "-c",
            "echo host={host} addr={addr} master={master}",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(namespace=True),
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "[host0] host=0 addr=10.213.0.1 master=10.213.0.1" in res.stdout
    assert "[host1] host=1 addr=10.213.0.2 master=10.213.0.1" in res.stdout


_OWNER = """
import time
from manygpu.emulate import EmulatedCluster
with EmulatedCluster(2) as c:
    child = c.popen(0, ["sleep", "300"])
    print(" ".join([c.switch, *c.names, str(child.pid)]), flush=True)
    time.sleep(300)
"""


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_sigkilled_run_is_cleaned_up_by_the_next_one() -> None:
    """SIGKILL leaves namespaces and processes; the next cluster removes exactly those."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        *names, child_pid = owner.stdout.readline().split()  # type: ignore[union-attr]
    finally:
        owner.kill()  # SIGKILL: no teardown runs
        owner.wait()
    child = int(child_pid)
    assert set(names) <= _netns() and not _gone(child)
    subprocess.run(["ip", "netns", "add", "mgsw-not-ours"], check=True)  # never touched
    try:
        with EmulatedCluster(1):
            assert not set(names) & _netns()
            assert "mgsw-not-ours" in _netns()
        deadline = time.monotonic() + 5
        while not _gone(child):
            assert time.monotonic() < deadline, "the stale host's process lives on"
            time.sleep(0.1)
    finally:
        subprocess.run(["ip", "netns", "del", "mgsw-not-ours"], check=False)
