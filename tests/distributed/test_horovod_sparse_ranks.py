"""Sparse gradients and hvd.sparse_allreduce_async on real gloo ranks.

A sparse ``nn.Embedding`` trained with ``torch.optim.SparseAdam`` (which
refuses dense gradients) through ``hvd.DistributedOptimizer`` must match one
process that averages the ranks' losses, with the gradient kept sparse; with
``sparse_as_dense=True`` it travels dense and is made sparse again. One job
per world size makes every check.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
from dist_harness import preload, run_ranks
from torch import nn

preload("manygpu.horovod")

TOL = 1e-5
"""float32, same losses, sums taken in another order (rounding only)."""
STEPS = 3
ROWS = 12  # samples per step for the whole job: 2 and 3 ranks split it evenly


class Tables(nn.Module):
    """Two sparse tables; ``extra`` is used only on rank 0 in the "missing" variant."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 3, sparse=True)
        self.extra = nn.Embedding(6, 2, sparse=True)


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 10, (ROWS, 4), generator=gen) for _ in range(STEPS)]


def _loss(model: Tables, idx: torch.Tensor, rank: int, variant: str) -> torch.Tensor:
    """A non-linear loss, so that the gradient's values depend on the weights."""
    out = ((model.table(idx).sum(dim=(1, 2)) - 1.0) ** 2).mean()
    if variant == "missing" and rank == 0:
        out = out + model.extra(idx[:, :2] % 6).pow(2).mean()
    return out


VARIANTS: dict[str, dict[str, Any]] = {
    "sparse": {},
    "dense": {"sparse_as_dense": True},
    "passes2": {"backward_passes_per_step": 2},
    "missing": {},  # extra's gradient exists on rank 0 only
}


def _train_rank(hvd: Any, variant: str) -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(5 + r)  # different weights on every rank: the broadcast sets them
    model = Tables()
    options = VARIANTS[variant]
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **options)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    passes = options.get("backward_passes_per_step", 1)
    per = ROWS // n
    seen: list[Any] = []
    for idx in _batches():
        shard = idx[r * per : (r + 1) * per]
        for part in shard.chunk(passes):
            (_loss(model, part, r, variant) / passes).backward()
        opt.synchronize()
        g, e = model.table.weight.grad, model.extra.weight.grad
        seen.append([g.is_sparse, g.sparse_dim(), e is not None and e.is_sparse])
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
    return {"params": {k: v.tolist() for k, v in model.state_dict().items()}, "seen": seen}


def reference(variant: str, world: int) -> dict[str, Any]:
    """One process, plain SparseAdam, rank 0's weights, the ranks' losses averaged."""
    torch.manual_seed(5)
    model = Tables()
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
    per = ROWS // world
    for idx in _batches():
        losses = [_loss(model, idx[r * per : (r + 1) * per], r, variant) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def _random_sparse(gen: torch.Generator, rows: int) -> torch.Tensor:
    t = torch.rand(rows, 5, generator=gen)
    t[t < 0.8] = 0
    return t.to_sparse()


def _async(hvd: Any) -> dict[str, Any]:
    """sparse_allreduce_async against the dense allreduce of the same tensors."""
    r = hvd.rank()
    gen = torch.Generator().manual_seed(40 + r)
    tensors = [_random_sparse(gen, rows) for rows in (17, 4, 9)]
    tensors.append(torch.zeros(6, 5).to_sparse())  # no entries at all on this rank
    if r == 1:
        tensors[1] = torch.zeros(4, 5).to_sparse()  # no entries here, some elsewhere
    out: dict[str, Any] = {"max_err": 0.0, "sparse": [], "nnz": [], "handles": []}
    for op in (hvd.Average, hvd.Sum):
        dense = [
            hvd.allreduce(t.to_dense(), op=op, name=f"d{i}{op}") for i, t in enumerate(tensors)
        ]
        handles = [
            hvd.sparse_allreduce_async(t, name=f"s{i}{op}", op=op) for i, t in enumerate(tensors)
        ]
        while not hvd.poll(handles[-1]):  # ready once both gathers are (a hang times out)
            time.sleep(0.001)
        out["handles"].append(hvd.poll(handles[-1]))
        # Horovod calls the handle; hvd.synchronize takes it as well.
        results = [h() if i % 2 else hvd.synchronize(h) for i, h in enumerate(handles)]
        for want, got in zip(dense, results, strict=True):
            out["max_err"] = max(out["max_err"], float((want - got.to_dense()).abs().max()))
            out["sparse"].append(got.is_sparse)
        out["nnz"].append([int(got._nnz()) for got in results])
        out["mine"] = [int(t._nnz()) for t in tensors]
    return out


def _job() -> dict[str, Any]:
    """Each part's answers, or its error (so one broken part does not hide the other)."""
    import manygpu.horovod as hvd

    hvd.init()
    out: dict[str, Any] = {}
    try:
        for part, run in (
            ("train", lambda: {v: _train_rank(hvd, v) for v in VARIANTS}),
            ("async", lambda: _async(hvd)),
        ):
            try:
                out[part] = run()
            except Exception as exc:  # reported by the test that checks this part
                out[part] = f"{type(exc).__name__}: {exc}"
                break  # the ranks may no longer agree on what comes next
    finally:
        hvd.shutdown()
    return out


@functools.cache
def _results(world: int) -> list[dict[str, Any]]:
    return run_ranks(_job, world, timeout=240)


def _part(world: int, part: str) -> list[Any]:
    results = [res.get(part, "not run: an earlier part failed") for res in _results(world)]
    errors = [f"rank {r}: {res}" for r, res in enumerate(results) if isinstance(res, str)]
    assert not errors, "\n".join(errors)
    return results


def _close(a: Any, b: Any) -> bool:
    return bool(torch.allclose(torch.tensor(a), torch.tensor(b), atol=TOL, rtol=0))


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_training_equals_one_process(world: int) -> None:
    results = _part(world, "train")
    for variant in VARIANTS:
        want = reference(variant, world)
        for rank, res in enumerate(results):
            got = res[variant]["params"]
            for key in want:
                assert _close(got[key], want[key]), (variant, rank, key)
    for rank, res in enumerate(results):
        # Gathered: sparse with one sparse dimension (rows); sparse_as_dense: dense
        # all-reduce then to_sparse() (every dimension sparse), as Horovod.
        for variant, dims in (("sparse", 1), ("passes2", 1), ("missing", 1), ("dense", 2)):
            seen = res[variant]["seen"]
            assert all(s[0] and s[1] == dims for s in seen), (variant, rank, seen)
        # The parameter only rank 0 had a gradient for is sparse on every rank after sync.
        assert all(s[2] for s in res["missing"]["seen"]), rank
        assert not any(s[2] for s in res["sparse"]["seen"]), rank


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_allreduce_async_equals_dense_allreduce(world: int) -> None:
    results = _part(world, "async")
    for rank, a in enumerate(results):
        assert a["max_err"] < TOL and all(a["sparse"]) and all(a["handles"]), rank
        # Horovod's result is uncoalesced: every rank's entries, added up when coalesced.
        total = [sum(other["mine"][i] for other in results) for i in range(4)]
        assert a["nnz"] == [total, total], rank
