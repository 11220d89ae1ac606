"""The emulated hosts themselves: network namespaces joined by a bridge, torn down
on exit, on SIGTERM and by the next run after a SIGKILL.

Needs root and iproute2; skips with the reason elsewhere. Training across these
hosts is tested where it matters: 2 hosts x 2 ranks with explicit flags against
one process in test_cluster_exposure.py (beside the strangers), through ssh in
test_launch_hosts.py, under each engine's environment in test_engine_contracts.py
and under real Slurm in test_slurm_real.py.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from jobs import subprocess_env

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")


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


_STORE = (
    "import datetime, torch.distributed as d\n"
    "s = d.TCPStore('{master}', 29531, 2, {host} == 0, timeout=datetime.timedelta(seconds=30))\n"
    "s.set('k{host}', 'v'); s.wait(['k0', 'k1']); print('met')\n"
)


def test_a_store_across_hosts_resolves_its_peers_quietly() -> None:
    """Every address has a name in the hosts' /etc/hosts (IPv4 and the IPv4-mapped form a
    dual-stack listener sees), so the TCPStore's reverse lookup of each client neither
    asks an unreachable DNS server nor warns "hostname of the client socket cannot be
    retrieved"."""
    argv = [sys.executable, "-m", "manygpu.emulate", "--hosts", "2", "--timeout", "60"]
    res = subprocess.run(
        [*argv, "--", sys.executable, "-c", _STORE],
        capture_output=True,
        text=True,
        env=subprocess_env(namespace=True),
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("met") == 2, res.stdout
    assert "hostname of the client socket" not in res.stdout + res.stderr


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
