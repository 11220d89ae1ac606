"""hvd.join() on real gloo ranks: uneven data per rank, and what a joined rank stands in for.

One job of two ranks checks it all: rank 0 has 5 batches and rank 1 has 3, both
train with DistributedOptimizer and join when their data ends; rank 0's last two
steps run while rank 1 stands in with zero gradients, so every step averages over
2 (Horovod's Average divides by the whole job). Each rank's parameters are compared
with the same training done here by hand, up to its last step. While rank 1 has joined, rank 0's
allreduce (every op, named and async, grouped, integer), barrier, and the calls
Horovod refuses then (allgather, broadcast, alltoall, reducescatter) are
checked; a second join, rank 0 first, shows who joined last. Also: rank 1 joins with a
named allreduce still deferred (rank 0 makes it later: the real values meet), rank 0
steps a second optimizer whose last bucket is launched after an allreduce made between
backward and step(), a bool allreduce with a prescale is refused without stranding
rank 1, and a process-set call is refused while rank 1 has joined.
"""

from __future__ import annotations

from typing import Any

import torch
from dist_harness import preload, run_ranks
from torch import nn

preload("manygpu.horovod")

BATCHES = (5, 3)
"""Batches of rank 0 and rank 1."""
LR = 0.1
TOL = 1e-6


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return ((model(x) - y) ** 2).mean()


def _while_joined(hvd: Any) -> dict[str, Any]:
    """Rank 0's calls while rank 1 stands in."""
    out: dict[str, Any] = {}
    x = torch.tensor([4.0, -6.0])
    out["avg"] = hvd.allreduce(x).tolist()
    out["sum"] = hvd.allreduce(x, op=hvd.Sum).tolist()
    out["max"] = hvd.allreduce(x, op=hvd.Max).tolist()  # the joined rank's zeros count
    handle = hvd.allreduce_async(x, name="named")
    out["named"] = hvd.synchronize(handle).tolist()
    out["int_avg"] = hvd.allreduce(torch.tensor([5, -7])).tolist()  # truncated, as Horovod
    grouped = hvd.grouped_allreduce([x, torch.tensor([3], dtype=torch.int16)], op=hvd.Sum)
    out["grouped"] = [t.tolist() for t in grouped] + [str(grouped[1].dtype)]
    hvd.barrier()
    rows = torch.ones(2, 2)
    calls = {
        "allgather": lambda: hvd.allgather(rows),
        "broadcast": lambda: hvd.broadcast(rows, root_rank=0),
        "alltoall": lambda: hvd.alltoall(rows),
        "reducescatter": lambda: hvd.reducescatter(rows),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "ran"
        except RuntimeError as exc:
            out[name] = [type(exc).__name__, str(exc)]
    out["after_refusals"] = hvd.allreduce(x, op=hvd.Sum).tolist()  # still standing in
    return out | _more_while_joined(hvd)


def _more_while_joined(hvd: Any) -> dict[str, Any]:
    """Rank 0: rank 1's deferred named call, a bucket launched after a round, bad scales,
    a process set."""
    out: dict[str, Any] = {}
    late = hvd.allreduce_async(torch.tensor([1.0]), name="late", op=hvd.Sum)
    out["late"] = hvd.synchronize(late).tolist()  # rank 1's real 10 takes part
    out["mixed"] = _bucket_then_round(hvd, hvd.rank())
    try:
        hvd.allreduce(torch.tensor([True]), op=hvd.Sum, prescale_factor=2.0)
        out["bool_scale"] = "ran"
    except ValueError as exc:
        out["bool_scale"] = str(exc)
    try:
        hvd.allreduce(torch.ones(1), process_set=_SETS[0])
        out["in_set"] = "ran"
    except RuntimeError as exc:
        out["in_set"] = [type(exc).__name__, str(exc)]
    out["after_more"] = hvd.allreduce(torch.tensor([5.0]), op=hvd.Sum).tolist()
    return out


_SETS: list[Any] = []
_SECOND: list[Any] = []
"""Rank 0's process set and the second optimizer (built on every rank)."""


def _bucket_then_round(hvd: Any, r: int) -> list[Any]:
    """Bucket 0 (``b``) goes at backward, then an allreduce, then bucket 1 (``a``, no
    gradient) at step(): a joined rank must stand in for them in that order."""
    opt, a, b = _SECOND
    opt.zero_grad()
    (b * 3.0).sum().backward()
    metric = hvd.allreduce(torch.tensor([7.0 + r]), op=hvd.Sum).tolist()
    opt.step()
    return [metric, a.detach().tolist(), b.detach().tolist(), a.grad is None]


def _job() -> dict[str, Any]:
    import manygpu.horovod as hvd

    hvd.init(process_sets="dynamic")
    r = hvd.rank()
    out: dict[str, Any] = {}
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters()
    )
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    second = torch.optim.SGD([a, b], lr=1.0)
    named = [("a", a), ("b", b)]
    _SECOND[:] = [hvd.DistributedOptimizer(second, named_parameters=named, num_groups=2), a, b]
    _SETS[:] = [hvd.add_process_set([0])]
    late = None
    for step in range(BATCHES[r]):
        opt.zero_grad()
        _loss(model, r, step).backward()
        opt.step()
        if step == BATCHES[1] - 1:  # rank 1 joins with its named call not started yet
            if r == 1:
                late = hvd.allreduce_async(torch.tensor([10.0]), name="late", op=hvd.Sum)
            else:
                out["metric"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).tolist()
    if r == 0:
        out["calls"] = _while_joined(hvd)
    out["join1"] = hvd.join()
    out["params"] = [p.detach().tolist() for p in model.parameters()]
    if r == 1:
        out["late"] = hvd.synchronize(late).tolist()
    if r == 1:  # now rank 0 joins first
        out["after"] = hvd.allreduce(torch.tensor([2.0])).tolist()
    out["join2"] = hvd.join()
    out["together"] = hvd.allreduce(torch.tensor([1.0 + r]), op=hvd.Sum).tolist()
    return out


def _reference(steps: int) -> list[list[Any]]:
    """The same training in one process: each step's gradient is the sum of the ranks that
    still have data, divided by 2."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        ranks = [r for r in range(2) if step < BATCHES[r]]
        (sum(_loss(model, r, step) for r in ranks) / 2).backward()
        opt.step()
    return [p.detach().tolist() for p in model.parameters()]


def _close(a: Any, b: Any) -> bool:
    return bool(torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=TOL))


def test_uneven_data_trains_and_joined_rank_stands_in() -> None:
    results = run_ranks(_job, 2, timeout=180)
    for r, res in enumerate(results):  # a joined rank stops stepping (as in Horovod)
        want = _reference(BATCHES[r])
        assert all(_close(got, ref) for got, ref in zip(res["params"], want, strict=True)), r
        assert res["join1"] == 0  # rank 1 ran out of data first
        assert res["join2"] == 1
        assert res["together"] == [3.0]  # after join, nobody stands in any more
    assert results[1]["after"] == [1.0]  # rank 0 stood in with zero
    calls = results[0]["calls"]
    assert calls["avg"] == [2.0, -3.0] and calls["named"] == [2.0, -3.0]
    assert calls["sum"] == [4.0, -6.0] and calls["max"] == [4.0, 0.0]
    assert calls["int_avg"] == [2, -3]
    assert calls["grouped"] == [[4.0, -6.0], [3], "torch.int16"]
    for name in ("allgather", "broadcast", "alltoall", "reducescatter"):
        kind, text = calls[name]
        assert kind == "JoinedRankError", (name, text)
        assert "not supported while rank 1 has joined" in text, text
    assert calls["after_refusals"] == [4.0, -6.0]
    assert results[0]["metric"] == [1.0]
    assert calls["late"] == results[1]["late"] == [11.0]  # not 1: rank 1's value counts
    # b's gradient 3 averaged over 2 ranks; a had none anywhere; rank 1's zero for the metric
    assert calls["mixed"] == [[7.0], [0.0, 0.0], [-1.5, -1.5], True]
    assert "prescale_factor=2.0 needs a numeric tensor, not torch.bool" in calls["bool_scale"]
    kind, text = calls["in_set"]
    assert kind == "JoinedRankError" and "process set" in text and "rank 1" in text, text
    assert calls["after_more"] == [5.0]
