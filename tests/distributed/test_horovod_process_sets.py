"""manygpu.horovod's process sets and grouped allgather / reducescatter on 3 gloo ranks.

Three ranks, so the set {0, 2} leaves a rank out and the set {1} is a set of
one: every operation on a set must give Horovod's answer computed over the
set's ranks only, a rank outside the set must get one clear error, and sets
are added and removed in order (ids reused as Horovod does). One job makes
every check and returns the answers; the test compares them with values
computed here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import preload, run_ranks

preload("manygpu.horovod")

EVEN, ODD = [0, 2], [1]


def _registry(hvd: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    even = hvd.add_process_set(EVEN)
    odd = hvd.add_process_set(hvd.ProcessSet(ODD))
    out["ids"] = [hvd.global_process_set.process_set_id, even.process_set_id, odd.process_set_id]
    out["sizes"] = [even.size(), odd.size(), hvd.global_process_set.size()]
    out["included"] = [even.included(), odd.included()]
    out["set_rank"] = (even if even.included() else odd).rank()
    try:
        hvd.add_process_set([2, 0])
    except ValueError as exc:
        out["duplicate"] = str(exc)
    out["removed"] = [hvd.remove_process_set(even), hvd.remove_process_set(even)]
    out["removed_id"] = even.process_set_id
    again = hvd.add_process_set(EVEN)
    out["reused_id"] = again.process_set_id  # the freed id 1 first, as Horovod
    out["global_not_removed"] = hvd.remove_process_set(hvd.global_process_set)
    hvd.remove_process_set(again)
    hvd.remove_process_set(odd)
    return out


def _ops(hvd: Any, r: int, ps: Any) -> dict[str, Any]:
    """Every operation on this rank's set; rows carry the global rank so order shows."""
    out: dict[str, Any] = {}
    x = torch.tensor([float(r + 1), 10.0 * (r + 1)])
    out["allreduce"] = hvd.allreduce(x, op=hvd.Sum, process_set=ps).tolist()
    out["average"] = hvd.allreduce(x, process_set=ps).tolist()
    y = x.clone()
    hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Max, process_set=ps))
    out["allreduce_async_"] = y.tolist()
    out["grouped"] = [
        t.tolist() for t in hvd.grouped_allreduce([x, x[:1].long()], op=hvd.Sum, process_set=ps)
    ]
    rows = torch.full((r + 1, 2), float(r))  # r + 1 rows: uneven first dimensions
    out["allgather"] = hvd.allgather(rows, process_set=ps).tolist()
    root = ps.ranks[-1]  # a global rank, as Horovod's root_rank
    out["broadcast"] = hvd.broadcast(x, root_rank=root, process_set=ps).tolist()
    z = x.clone()
    hvd.broadcast_(z, root_rank=root, process_set=ps)
    out["broadcast_"] = z.tolist()
    n = ps.size()
    out["alltoall"] = hvd.alltoall(torch.full((n,), float(r)), process_set=ps).tolist()
    out["reducescatter"] = hvd.reducescatter(
        torch.arange(5.0) * (r + 1), op=hvd.Sum, process_set=ps
    ).tolist()
    out["object"] = hvd.broadcast_object({"from": r}, root_rank=root, process_set=ps)
    out["objects"] = hvd.allgather_object(r, process_set=ps)
    hvd.barrier(process_set=ps)
    g = x.clone().requires_grad_()
    (hvd.allgather(g.unsqueeze(0), process_set=ps) * (r + 1) ** 2).sum().backward()
    out["allgather_grad"] = g.grad.tolist()
    return out


def _grouped(hvd: Any, r: int, ps: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    a, b = torch.full((r + 1, 2), float(r)), torch.tensor([r, 2 * r])
    handle = hvd.grouped_allgather_async([a, b], process_set=ps)
    out["gather_async"] = [t.tolist() for t in hvd.synchronize(handle)]
    out["gather_world"] = [t.tolist() for t in hvd.grouped_allgather([a, b])]
    c, d = torch.arange(4.0) * (r + 1), torch.ones(3, 2, dtype=torch.float64) * r
    parts = hvd.grouped_reducescatter([c, d], op=hvd.Sum, process_set=ps)
    out["scatter"] = [t.tolist() for t in parts]
    handle = hvd.grouped_reducescatter_async([c], postscale_factor=2.0)
    out["scatter_world_avg"] = [t.tolist() for t in hvd.synchronize(handle)]
    g = torch.full((2, 2), float(r + 1), requires_grad=True)
    (hvd.grouped_reducescatter([g], op=hvd.Sum)[0] * (r + 1)).sum().backward()
    out["scatter_grad"] = g.grad.tolist()
    return out


def _outsider(hvd: Any, r: int, even: Any) -> dict[str, str]:
    """Rank 1 calls operations on {0, 2}: each a clear error, raised before any data moves."""
    if r != 1:
        return {}
    errors = {}
    calls = {
        "allreduce": lambda: hvd.allreduce(torch.ones(2), process_set=even),
        "allgather": lambda: hvd.allgather(torch.ones(2), process_set=even),
        "broadcast": lambda: hvd.broadcast(torch.ones(2), 0, process_set=even),
        "barrier": lambda: hvd.barrier(process_set=even),
        "grouped_allgather": lambda: hvd.grouped_allgather([torch.ones(1)], process_set=even),
        "rank": even.rank,
    }
    for name, call in calls.items():
        try:
            call()
            errors[name] = "no error"
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def _static() -> dict[str, Any]:
    """``hvd.init(process_sets=[...])``: ids in the order given; adding more is refused."""
    import os

    import manygpu.horovod as hvd

    os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
    even, odd = hvd.ProcessSet(EVEN), hvd.ProcessSet(ODD)
    hvd.init(process_sets=[even, odd])
    try:
        r = hvd.rank()
        out: dict[str, Any] = {"ids": [even.process_set_id, odd.process_set_id]}
        mine = even if r in EVEN else odd
        out["sum"] = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=mine).tolist()
        try:
            hvd.add_process_set([0, 1])
        except ValueError as exc:
            out["not_dynamic"] = str(exc)
    finally:
        hvd.shutdown()
    return out


def _mismatch(hvd: Any, r: int, even: Any) -> str | None:
    """Ranks 0 and 2 disagree on a shape in their set; rank 1 is not involved."""
    if r not in EVEN:
        return None
    try:
        hvd.allreduce(torch.ones(2 if r == 0 else 3), process_set=even)
    except hvd.HorovodMismatchError as exc:
        return str(exc)
    return "no error"


def _job() -> dict[str, Any]:
    import os

    import manygpu.horovod as hvd

    os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
    hvd.init(process_sets="dynamic")
    try:
        r = hvd.rank()
        out: dict[str, Any] = {"registry": _registry(hvd)}
        even, odd = hvd.add_process_set(EVEN), hvd.add_process_set(ODD)
        mine = even if r in EVEN else odd
        out["ops"], out["grouped"] = _ops(hvd, r, mine), _grouped(hvd, r, mine)
        out["outsider"] = _outsider(hvd, r, even)
        out["mismatch"] = _mismatch(hvd, r, even)
        out["after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).tolist()
    finally:
        hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    static = run_ranks(_static, 3, timeout=120)
    return [
        res | {"static": st}
        for res, st in zip(run_ranks(_job, 3, timeout=240), static, strict=True)
    ]


def test_sets_are_added_and_removed_in_order_with_horovods_ids(
    results: list[dict[str, Any]],
) -> None:
    for r, res in enumerate(results):
        reg = res["registry"]
        assert reg["ids"] == [0, 1, 2] and reg["sizes"] == [2, 1, 3]
        assert reg["included"] == [r in EVEN, r in ODD]
        assert reg["set_rank"] == {0: 0, 1: 0, 2: 1}[r]
        assert "a process set with ranks [0, 2] exists already" in reg["duplicate"]
        assert reg["removed"] == [True, False] and reg["removed_id"] is None
        assert reg["reused_id"] == 1 and reg["global_not_removed"] is False
        static = res["static"]
        assert static["ids"] == [1, 2]
        assert static["sum"] == ([4.0] if r in EVEN else [2.0])
        assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in static["not_dynamic"]


def test_every_operation_on_a_set_gives_horovods_answer(results: list[dict[str, Any]]) -> None:
    even_rows = [[0.0, 0.0]] + [[2.0, 2.0]] * 3
    expected = {
        "even": {
            "allreduce": [4.0, 40.0], "average": [2.0, 20.0], "allreduce_async_": [3.0, 30.0],
            "grouped": [[4.0, 40.0], [4]], "allgather": even_rows, "broadcast": [3.0, 30.0],
            "broadcast_": [3.0, 30.0], "alltoall": [0.0, 2.0], "object": {"from": 2},
            "objects": [0, 2], "allgather_grad": [5.0, 5.0],
        },
        "odd": {
            "allreduce": [2.0, 20.0], "average": [2.0, 20.0], "allreduce_async_": [2.0, 20.0],
            "grouped": [[2.0, 20.0], [2]], "allgather": [[1.0, 1.0]] * 2,
            "broadcast": [2.0, 20.0], "broadcast_": [2.0, 20.0], "alltoall": [1.0],
            "object": {"from": 1}, "objects": [1], "allgather_grad": [4.0, 4.0],
            "reducescatter": [0.0, 2.0, 4.0, 6.0, 8.0],
        },
    }  # fmt: skip
    scatter = {0: [0.0, 4.0, 8.0], 2: [12.0, 16.0]}
    for r, res in enumerate(results):
        want = dict(expected["even" if r in EVEN else "odd"])
        want.setdefault("reducescatter", scatter.get(r))
        assert res["ops"] == want, f"rank {r}"
        assert res["after"] == [3.0]


def test_grouped_allgather_and_reducescatter(results: list[dict[str, Any]]) -> None:
    world_a = [[0.0, 0.0]] + [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 3
    c_parts = {0: [0.0, 4.0], 1: [0.0, 2.0, 4.0, 6.0], 2: [8.0, 12.0]}
    d_parts = {0: [[2.0, 2.0]] * 2, 1: [[1.0, 1.0]] * 3, 2: [[2.0, 2.0]]}
    for r, res in enumerate(results):
        got = res["grouped"]
        if r in EVEN:
            assert got["gather_async"] == [[[0.0, 0.0]] + [[2.0, 2.0]] * 3, [0, 0, 2, 4]]
        else:
            assert got["gather_async"] == [[[1.0, 1.0]] * 2, [1, 2]]
        assert got["gather_world"] == [world_a, [0, 0, 1, 2, 2, 4]]
        assert got["scatter"] == [c_parts[r], d_parts[r]]
        assert got["scatter_world_avg"] == [[[0.0, 4.0], [8.0], [12.0]][r]]
        assert got["scatter_grad"] == [[3.0, 3.0], [6.0, 6.0]]  # Horovod: Sum's grad x size


def test_a_rank_outside_the_set_gets_one_clear_error(results: list[dict[str, Any]]) -> None:
    errors = results[1]["outsider"]
    assert set(errors) == {
        "allreduce", "allgather", "broadcast", "barrier", "grouped_allgather", "rank",
    }  # fmt: skip
    for name, text in errors.items():
        assert "rank 1 is not" in text and "[0, 2]" in text, (name, text)
        assert "\n" not in text


def test_a_mismatch_inside_a_set_names_its_ranks(results: list[dict[str, Any]]) -> None:
    assert results[1]["mismatch"] is None
    for r in EVEN:
        text = results[r]["mismatch"]
        assert "rank 0 calls allreduce(float32[2]" in text
        assert "rank 2 calls allreduce(float32[3]" in text
        assert "process set 1 (ranks [0, 2])" in text
