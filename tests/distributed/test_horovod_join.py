"""hvd.join() on real gloo ranks: uneven data per rank, and what a joined rank stands in for.

One job of two ranks checks it all: rank 0 has 5 batches and rank 1 has 3, both
train with DistributedOptimizer and join when their data ends; rank 0's last two
steps run while rank 1 stands in with zero gradients, so every step averages over
2 (Horovod's Average divides by the whole job). Each rank's parameters are compared
with the same training done here by hand, up to its last step. While rank 1 has joined, rank 0's
allreduce (every op, named and async, grouped, integer), barrier, and the calls
Horovod refuses then (allgather, broadcast, alltoall, reducescatter) are
checked; a second join, rank 0 first, shows who joined last.
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
    return out


def _job() -> dict[str, Any]:
    import manygpu.horovod as hvd

    hvd.init()
    r = hvd.rank()
    out: dict[str, Any] = {}
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters()
    )
    for step in range(BATCHES[r]):
        opt.zero_grad()
        _loss(model, r, step).backward()
        opt.step()
    if r == 0:
        out["calls"] = _while_joined(hvd)
    out["join1"] = hvd.join()
    out["params"] = [p.detach().tolist() for p in model.parameters()]
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
