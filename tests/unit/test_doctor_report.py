"""Checks across ranks and of the live test; the report as data and as text."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from manygpu.doctor.crosscheck import check_consistency, check_links, check_live
from manygpu.doctor.facts import Facts, LiveResults, PairResult
from manygpu.doctor.live import build_report, merge_pairs, node_labels, pairs
from manygpu.doctor.report import DoctorReport, render

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"


def load(name: str) -> Facts:
    return Facts.from_dict(json.loads((FIXTURES / f"{name}.json").read_text()))


def cluster(nodes: int, per_node: int) -> list[Facts]:
    """Per-rank facts of ``nodes`` copies of the H100 box."""
    base = load("h100_sxm_8x")
    out = []
    for n in range(nodes):
        for _ in range(per_node):
            f = copy.deepcopy(base)
            f.system.hostname = f"node{n}"
            out.append(f)
    return out


def live_of(speeds: dict[tuple[int, int], float | None], world: int) -> LiveResults:
    return LiveResults(
        backend="nccl",
        world_size=world,
        hosts=[f"node{r // 2}" for r in range(world)],
        nbytes=4 << 20,
        all_reduce_ms=1.2,
        pairs=[
            PairResult(a=a, b=b, seconds=0.01, gbps=s)
            if s is not None
            else PairResult(a=a, b=b, error="recv[src=1] did not complete within 20s")
            for (a, b), s in speeds.items()
        ],
    )


def test_consistent_cluster_is_ok() -> None:
    results = check_consistency(cluster(2, 2))
    assert [r.status for r in results] == ["ok"]
    assert "4 ranks on 2 node(s)" in results[0].message


def test_different_torch_on_one_node_fails_and_names_it() -> None:
    ranks = cluster(2, 2)
    for f in ranks[2:]:
        f.torch.version = "2.4.0+cu121"
        f.driver.version = "535.104.05"
    results = check_consistency(ranks)
    statuses = {r.message.split(" differs")[0]: r.status for r in results}
    assert statuses == {"torch": "fail", "driver": "warn"}
    torch_msg = next(r.message for r in results if r.message.startswith("torch"))
    assert "2.5.1+cu124 on ranks 0, 1 (node0)" in torch_msg
    assert "2.4.0+cu121 on ranks 2, 3 (node1)" in torch_msg


def test_gpu_model_difference_warns() -> None:
    ranks = cluster(2, 1)
    for g in ranks[1].gpus:
        g.name = "NVIDIA A100-SXM4-80GB"
    (result,) = check_consistency(ranks)
    assert result.status == "warn" and result.message.startswith("GPU model differs")


def test_links_ok() -> None:
    live = live_of({(0, 1): 20.0, (0, 2): 21.0, (1, 2): 19.0}, 3)
    results = check_live(live)
    assert [(r.name, r.status) for r in results] == [("all_reduce", "ok"), ("links", "ok")]
    assert "median 20" in results[1].message


def test_slow_link_is_named() -> None:
    speeds = {p: 20.0 for p in pairs(4)}
    speeds[(1, 3)] = 0.5
    results = check_links(live_of(speeds, 4))
    (slow,) = results
    assert slow.status == "warn"
    assert slow.message.startswith("link rank 1 (node0) <-> rank 3 (node1) runs at 0.5 GB/s")
    assert "2% of the median pair" in slow.message


def test_broken_link_fails_and_a_bad_node_is_named() -> None:
    speeds: dict[tuple[int, int], float | None] = {p: 20.0 for p in pairs(4)}
    for p in ((0, 2), (1, 2), (2, 3)):
        speeds[p] = None
    results = check_links(live_of(speeds, 4))
    assert results[0].name == "node" and results[0].status == "fail"
    assert results[0].message == "rank 2 (node1) is slow or broken with every peer"
    broken = [r for r in results if r.name == "link"]
    assert len(broken) == 3 and all(r.status == "fail" for r in broken)
    assert "did not complete within 20s" in broken[0].message


def test_failed_all_reduce() -> None:
    live = live_of({(0, 1): 1.0}, 2)
    live.all_reduce_ms, live.all_reduce_error = None, "rank 0: all_reduce[sum] timed out"
    assert check_live(live)[0].status == "fail"


def test_merge_pairs_keeps_errors_and_the_slower_side() -> None:
    rank0 = [{"a": 0, "b": 1, "seconds": 0.01, "gbps": 4.0, "error": None}]
    rank1 = [{"a": 0, "b": 1, "seconds": 0.02, "gbps": 2.0, "error": None}]
    assert merge_pairs([rank0, rank1])[0].gbps == 2.0
    rank1[0] |= {"seconds": None, "gbps": None, "error": "boom"}
    assert merge_pairs([rank0, rank1])[0].error == "boom"
    assert merge_pairs([rank1, rank0])[0].error == "boom"


def test_build_report_for_two_nodes() -> None:
    ranks = cluster(2, 2)
    ranks[2].limits.shm_bytes = 64 << 20  # a node's facts are its first rank's
    live = live_of({p: 20.0 for p in pairs(4)}, 4)
    report = build_report(ranks, live, [0, 0, 1, 1])
    assert [n.system.hostname for n in report.nodes] == ["node0", "node1"]
    shm = [c for c in report.checks if c.name == "shm"]
    assert [(c.host, c.status) for c in shm] == [("node0", "ok"), ("node1", "fail")]
    assert report.status == "fail" and report.exit_code == 1


def test_nodes_sharing_a_hostname_are_told_apart() -> None:
    ranks = cluster(2, 2)
    for f in ranks:
        f.system.hostname = "vm"  # containers / network namespaces keep the host's name
    assert node_labels(ranks, [0, 0, 1, 1]) == ["vm#0", "vm#0", "vm#1", "vm#1"]
    assert node_labels(ranks[:2], [0, 0]) == ["vm", "vm"]
    ranks[3].torch.version = "2.4.0"
    report = build_report(ranks, live_of({p: 1.0 for p in pairs(4)}, 4), [0, 0, 1, 1])
    assert len(report.nodes) == 2
    assert report.live is not None and report.live.hosts == ["vm#0", "vm#0", "vm#1", "vm#1"]
    torch_msg = next(c.message for c in report.checks if c.message.startswith("torch differs"))
    assert "2.4.0 on rank 3 (vm#1)" in torch_msg


def test_report_round_trips_and_renders() -> None:
    report = build_report([load("a100_pcie_4x")], live_of({(0, 1): 5.0}, 2))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["status"] == "fail"
    assert data["counts"]["fail"] == 2
    assert {"status", "counts", "checks", "nodes", "live"} <= set(data)
    back = DoctorReport.from_dict(data)
    assert back.nodes == report.nodes and back.checks == report.checks and back.live == report.live
    out = io.StringIO()
    render(report, Console(file=out, width=200, highlight=False))
    text = out.getvalue()
    for expected in (
        "Machine",
        "NVIDIA A100 80GB PCIe",
        "GPU topology on a100-pcie-2",
        "SYS!",
        "PXB",
        "/dev/shm is 64 MB",
        "FAIL: ",
        "48213 python3",
    ):
        assert expected in text, expected


@pytest.mark.parametrize("world", [1, 2, 5])
def test_every_pair_once_in_a_shared_order(world: int) -> None:
    got = pairs(world)
    assert len(got) == len(set(got)) == world * (world - 1) // 2
    assert all(a < b for a, b in got)


def test_cpu_report_says_no_gpu() -> None:
    f = load("h100_sxm_8x")
    f.gpus, f.links = [], []
    out = io.StringIO()
    render(build_report([f], None), Console(file=out, width=200))
    assert "No GPU here: checked the CPU / gloo path." in out.getvalue()
