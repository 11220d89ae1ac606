"""``manygpu doctor --all-ranks`` across 2 emulated hosts (network namespaces).

Needs root and iproute2; skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import sys

import pytest
from jobs import subprocess_env

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")


def test_doctor_all_ranks_across_two_hosts() -> None:
    with EmulatedCluster(2, LinkShape(rate="200mbit")) as cluster:
        argv = [
            [
                sys.executable,
                "-m",
                "manygpu",
                "doctor",
                "--all-ranks",
                "--json",
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--nproc-per-node",
                "2",
                "--master-addr",
                cluster.addresses[0],
                "--master-port",
                "29561",
                "--p2p-bytes",
                "1M",
                "--timeout",
                "60",
            ]
            for i in range(2)
        ]
        results = cluster.run_all(argv, timeout=150, env=subprocess_env(namespace=True))
        addresses = list(cluster.addresses)
    for node, res in enumerate(results):
        assert res.returncode in (0, 1), f"node {node}:\n{res.stderr[-3000:]}"
    # Rank 0 is on node 0 with a static rendezvous: its stdout holds the report.
    report = json.loads(results[0].stdout)
    assert results[1].stdout.strip() == ""
    expected = 1 if report["status"] == "fail" else 0
    assert [r.returncode for r in results] == [expected, expected]  # every node agrees
    assert len(report["nodes"]) == 2
    gloo = sorted(n["network"]["gloo_address"] for n in report["nodes"])
    assert gloo == sorted(addresses)
    live = report["live"]
    assert live["world_size"] == 4 and len(live["pairs"]) == 6
    assert all(p["error"] is None for p in live["pairs"]), live["pairs"]
    # Pairs inside a host go over loopback-fast memory, pairs across hosts over
    # the 200 Mbit/s link (25 MB/s): the doctor sees the difference.
    cross = [p["gbps"] for p in live["pairs"] if live["hosts"][p["a"]] != live["hosts"][p["b"]]]
    local = [p["gbps"] for p in live["pairs"] if live["hosts"][p["a"]] == live["hosts"][p["b"]]]
    assert len(cross) == 4 and len(local) == 2
    assert max(cross) < 0.05 < min(local), live["pairs"]
    checks = {c["name"]: c["status"] for c in report["checks"]}
    assert checks["consistency"] == "ok" and checks["all_reduce"] == "ok"
    hosts = {c["host"] for c in report["checks"] if c["name"] == "shm"}
    assert len(hosts) == 2  # every node checked, and told apart
