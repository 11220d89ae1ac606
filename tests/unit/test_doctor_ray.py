"""``manygpu doctor --ray``: what the child driver printed -> a RayCluster -> checks -> views.

No Ray process here: :func:`interpret` and :func:`check_ray` are pure. The
real cluster's report is checked in tests/cluster/test_ray_hosts.py; the
deadline against an address nothing answers on is the one slow test below.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import tomllib
from rich.console import Console

from manygpu.doctor.ray_checks import check_ray
from manygpu.doctor.ray_cluster import RayCluster, interpret, probe
from manygpu.doctor.report import DoctorReport, render
from manygpu.runtime.ray_train import RAY_VERSION

ROOT = Path(__file__).resolve().parents[2]


def _node(i: int, **kw: object) -> dict[str, object]:
    return {"node_id": f"{i:02d}" * 14, "host": f"h{i}", "ip": f"10.0.0.{i}", "alive": True,
            "head": i == 0, "cpus": 2.0, "gpus": 0.0, "memory_bytes": 4 << 30} | kw  # fmt: skip


def _soft(**kw: object) -> dict[str, object]:
    return {"ray": RAY_VERSION, "train_error": None, "torch": "2.13.0", "cuda_devices": 0,
            "manygpu": "0.1.0"} | kw  # fmt: skip


def _out(nodes: list[dict[str, object]], software: dict[str, object] | None) -> str:
    lines = ["2026-01-01 INFO worker.py: Connecting to existing Ray cluster",
             json.dumps({"nodes": nodes, "ray": RAY_VERSION})]  # fmt: skip
    if software is not None:
        lines.append(json.dumps({"software": software}))
    return "\n".join(lines)


def _statuses(cluster: RayCluster) -> list[tuple[str, str]]:
    return [(c.status, c.message) for c in check_ray(cluster)]


def test_the_pin_is_the_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["ray"] == [f"ray[train]=={RAY_VERSION}"]


def test_a_healthy_cluster_is_one_ok_line_and_a_table() -> None:
    nodes = [_node(0), _node(1, gpus=8.0, accelerator="H100")]
    soft = {nodes[0]["node_id"]: _soft(), nodes[1]["node_id"]: _soft(cuda_devices=8)}
    cluster = interpret("10.0.0.0:6379", 20, _out(nodes, soft), "", 0)
    assert [n.software is not None for n in cluster.nodes] == [True, True]
    assert _statuses(cluster) == [
        ("ok", "2 node(s) alive at 10.0.0.0:6379: 4 CPUs, 8 GPUs"),
    ]
    report = DoctorReport(nodes=[], checks=check_ray(cluster), ray=cluster)
    assert DoctorReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    text = io.StringIO()
    render(report, Console(file=text, width=200))
    assert "Ray cluster at 10.0.0.0:6379" in text.getvalue()
    assert "8 H100" in text.getvalue() and "Machine" not in text.getvalue()


def test_no_ray_no_answer_no_nodes_each_one_line() -> None:
    assert _statuses(RayCluster(address="auto", timeout_s=5, installed=False)) == [
        ("fail", "Ray is not installed here")
    ]
    late = interpret("10.9.9.9:6379", 5, "", "", None)
    assert _statuses(late) == [
        ("fail", "cannot reach the Ray cluster at 10.9.9.9:6379: "
                 "no Ray cluster answered at 10.9.9.9:6379 within 5s")
    ]  # fmt: skip
    said = json.dumps({"error": "ConnectionError: Could not find any running Ray instance."})
    (check,) = check_ray(interpret("auto", 5, said, "", 2))
    assert check.status == "fail" and "Could not find any running Ray" in check.message
    (crash,) = check_ray(interpret("auto", 5, "", "Traceback\nImportError: no pyarrow\n", 1))
    assert crash.message.endswith("ImportError: no pyarrow")
    empty = interpret("h:6379", 5, _out([_node(0, alive=False)], {}), "", 0)
    assert [c.status for c in check_ray(empty)] == ["fail"]
    assert "no alive node" in check_ray(empty)[0].message


def test_every_node_problem_is_named_with_its_node() -> None:
    nodes = [_node(0), _node(1, gpus=4.0), _node(2), _node(3, alive=False)]
    soft = {
        nodes[0]["node_id"]: _soft(ray="2.59.0", manygpu=None),
        nodes[1]["node_id"]: _soft(train_error="No module named 'pyarrow'", cuda_devices=8),
        # node 2 never answered (killed at the deadline after the node list)
    }
    cluster = interpret("h:6379", 7, _out(nodes, soft), "", None)
    found = _statuses(cluster)
    assert found[0] == ("ok", "3 node(s) alive at h:6379: 6 CPUs, 4 GPUs")
    assert ("warn", "1 node(s) listed dead: 10.0.0.3") in found
    pinned = f"manygpu[ray] is tested with Ray {RAY_VERSION}"
    assert ("warn", f"Ray 2.59.0 on 10.0.0.0: {pinned}") in found
    no_train = "node 10.0.0.1 cannot import ray.train.torch: No module named 'pyarrow'"
    assert ("fail", no_train) in found
    assert ("warn", "node 10.0.0.1: Ray offers 4 GPU(s), torch sees 8") in found
    assert ("warn", "node 10.0.0.2 did not answer within 7s: its software is unknown") in found
    assert any(s == "warn" and "10.0.0.0 has no manygpu" in m for s, m in found)
    assert len(found) == 7, found
    assert DoctorReport(nodes=[], checks=check_ray(cluster)).exit_code == 1


@pytest.mark.slow
def test_an_address_nothing_answers_on_ends_at_the_deadline() -> None:
    pytest.importorskip("ray", reason="Ray Train is not installed (pip install 'manygpu[ray]')")
    start = time.monotonic()
    cluster = probe("127.0.0.1:1", 2)
    assert cluster.timed_out and cluster.error == "no Ray cluster answered at 127.0.0.1:1 within 2s"
    assert time.monotonic() - start < 2 + 3 + 5  # the deadline, the grace, a slow start
