"""manygpu.horovod on real gloo ranks: every function, training equivalence, errors.

Spawning ranks is what costs, so each world size runs one job that makes every
check and returns the answers; the test then compares them with values
computed here in one process. The errors (a mismatch between ranks, a stall)
run in a job of their own, with a short collective timeout.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
from dist_harness import preload, run_ranks
from torch import nn

preload("manygpu.horovod")

TOL = 1e-5
"""DistributedOptimizer vs one process, float32, same global batch (rounding only)."""
FP16_TOL = 5e-4
"""With Compression.fp16: gradients travel with ~3 significant digits (float16's 11-bit
mantissa), 3 steps at lr 0.1; the error measured at 2 ranks is 4e-5 (plain: 3e-8)."""
GLOBAL_BATCH = 12
STEPS = 3


# -- every function -------------------------------------------------------------------
def _reductions(hvd: Any, r: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = torch.tensor([r + 1.0, 2.0 * (r + 1)])
    out["avg"] = hvd.allreduce(x).tolist()
    out["input_untouched"] = x.tolist()
    for op in ("Sum", "Min", "Max", "Product"):
        out[op] = hvd.allreduce(x, op=getattr(hvd, op), name=f"x.{op}").tolist()
    out["int_avg"] = hvd.allreduce(torch.tensor([3 * r + 1])).tolist()  # floor division
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["average_false"] = hvd.allreduce(x, average=False).tolist()
    out["deprecation"] = any(issubclass(w.category, DeprecationWarning) for w in caught)
    out["scaled_sum"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)
    out["scaled_avg"] = hvd.allreduce(x, prescale_factor=2.0, postscale_factor=3.0).tolist()
    out["scaled_sum"] = out["scaled_sum"].tolist()
    y = x.clone()
    out["inplace_is_same"] = hvd.allreduce_(y, op=hvd.Sum) is y
    out["inplace"] = y.tolist()
    handle = hvd.allreduce_async(x, name="async")
    result = hvd.synchronize(handle)
    out["async"], out["async_input"] = result.tolist(), x.tolist()
    z = x.clone()
    handle = hvd.allreduce_async_(z, op=hvd.Max)
    while not hvd.poll(handle):
        time.sleep(0.001)
    out["async_inplace"] = [hvd.synchronize(handle) is z, z.tolist()]
    out["sync_again"] = hvd.synchronize(handle)  # Horovod: an old handle gives None
    half = hvd.allreduce(x, compression=hvd.Compression.fp16)
    out["fp16"] = [str(half.dtype), half.tolist()]
    g = x.clone().requires_grad_()
    (hvd.allreduce(g, op=hvd.Sum) * (r + 1)).sum().backward()
    out["allreduce_grad"] = g.grad.tolist()
    a, b = torch.full((2, 2), float(r)), torch.tensor([r, 2 * r])
    out["grouped"] = [t.tolist() for t in hvd.grouped_allreduce([a, b], op=hvd.Sum)]
    hvd.grouped_allreduce_([a, b], op=hvd.Sum)
    out["grouped_inplace"] = [a.tolist(), b.tolist()]
    handle = hvd.grouped_allreduce_async([x, x * 2])
    out["grouped_async"] = [t.tolist() for t in hvd.synchronize(handle)]
    return out


def _data_moves(hvd: Any, r: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = torch.tensor([[r, 10 * r]] * (r + 1), dtype=torch.float32)  # r+1 rows: uneven
    out["allgather"] = hvd.allgather(rows).tolist()
    out["allgather_async"] = hvd.synchronize(hvd.allgather_async(rows[:, :1])).tolist()
    g = rows.clone().requires_grad_()
    (hvd.allgather(g) * (r + 1)).sum().backward()
    out["allgather_grad"] = g.grad.tolist()
    v = torch.tensor([r * 1.0, r + 0.5])
    out["broadcast"] = [hvd.broadcast(v, 1).tolist(), v.tolist()]
    w = v.clone()
    hvd.broadcast_(w, root_rank=n - 1)
    out["broadcast_"] = w.tolist()
    out["broadcast_async_"] = hvd.synchronize(hvd.broadcast_async_(v.clone(), 0)).tolist()
    gb = v.clone().requires_grad_()
    (hvd.broadcast(gb, 1) * (r + 1)).sum().backward()
    out["broadcast_grad"] = gb.grad.tolist()
    even = torch.tensor([r * 100.0 + j for j in range(2 * n)])
    out["alltoall"] = hvd.alltoall(even).tolist()
    splits = [r + j + 1 for j in range(n)]
    uneven = torch.tensor([r * 1000.0 + k for k in range(sum(splits))])
    got, received = hvd.alltoall(uneven, splits=splits)
    out["alltoall_splits"] = [got.tolist(), received.tolist(), str(received.dtype)]
    got, received = hvd.synchronize(hvd.alltoall_async(uneven, splits=torch.tensor(splits)))
    out["alltoall_async"] = [got.tolist(), received.tolist()]
    ga = even.clone().requires_grad_()
    (hvd.alltoall(ga) * (r + 1)).sum().backward()
    out["alltoall_grad"] = ga.grad.tolist()
    big = torch.arange(2 * (2 * n + 1), dtype=torch.float32).reshape(2 * n + 1, 2) * (r + 1)
    out["reducescatter"] = hvd.reducescatter(big).tolist()  # Average, uneven rows
    even_rows = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2) * (r + 1)
    out["reducescatter_sum"] = hvd.reducescatter(even_rows, op=hvd.Sum).tolist()
    out["reducescatter_async"] = hvd.synchronize(hvd.reducescatter_async(even_rows)).tolist()
    gr = even_rows.clone().requires_grad_()
    (hvd.reducescatter(gr, op=hvd.Sum) * (r + 1)).sum().backward()
    out["reducescatter_grad"] = gr.grad.tolist()
    return out


def _identity(hvd: Any) -> dict[str, Any]:
    names = ("size", "rank", "local_size", "local_rank", "cross_size", "cross_rank")
    out = {name: getattr(hvd, name)() for name in names}
    out |= {
        "initialized": hvd.is_initialized(),
        "homogeneous": hvd.is_homogeneous(),
        "built": [hvd.nccl_built(), hvd.gloo_built(), hvd.mpi_built()],
        "gloo_enabled": hvd.gloo_enabled(),
    }
    return out


def _objects(hvd: Any, r: int) -> dict[str, Any]:
    hvd.barrier()
    return {
        "broadcast_object": hvd.broadcast_object({"from": r, "list": [r]}, root_rank=1),
        "allgather_object": hvd.allgather_object(("rank", r)),
        "join": hvd.join(),
    }


# -- training ------------------------------------------------------------------------
class Net(nn.Module):
    """Two layers and a parameter no batch ever uses (its gradient must stay None)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, 5, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen))
        for _ in range(STEPS + 1)  # the last batch is the pre-step some variants take
    ]


def _make(variant: str, seed: int) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    if variant == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=0.05)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "passes2": {"backward_passes_per_step": 2},
    "fp16": {"compression": "fp16"},
    "predivide": {"gradient_predivide_factor": 4.0},
    "tiny_buckets": {"bucket_cap_mb": 1e-6},  # one parameter per bucket
    "clip": {},  # synchronize(), clip_grad_norm_, step() in skip_synchronize()
    "adam": {},  # rank 0 stepped before wrapping; the others' state is empty
}


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _train_rank(hvd: Any, variant: str) -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    data = _data()
    model, opt = _make(variant, seed=100 + r)  # every rank starts from different weights
    if variant == "adam" and r == 0:
        _loss(model, *data[-1]).backward()
        opt.step()
        opt.zero_grad()
    options = dict(VARIANTS[variant])
    if options.get("compression") == "fp16":
        options["compression"] = hvd.Compression.fp16
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **options)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    passes = options.get("backward_passes_per_step", 1)
    per = GLOBAL_BATCH // n
    for x, y in data[:STEPS]:
        xs, ys = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        for xm, ym in zip(xs.chunk(passes), ys.chunk(passes), strict=True):
            (_loss(model, xm, ym) / passes).backward()
        if variant == "clip":
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    return {
        "params": {k: v.tolist() for k, v in model.state_dict().items()},
        "unused_grad": model.unused.grad,
        "type": [type(opt).__name__, isinstance(opt, type(_make(variant, 0)[1]))],
    }


def reference(variant: str) -> dict[str, list[Any]]:
    """One process, plain torch, the global batch, rank 0's initial weights."""
    data = _data()
    model, opt = _make(variant, seed=100)
    if variant == "adam":
        _loss(model, *data[-1]).backward()
        opt.step()
        opt.zero_grad()
    for x, y in data[:STEPS]:
        _loss(model, x, y).backward()
        if variant == "clip":
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def _overlap(hvd: Any) -> list[int]:
    """Buckets launched by the end of backward (before step) out of all buckets."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(opt, model.named_parameters(), bucket_cap_mb=1e-6)
    _loss(model, torch.randn(4, 5), torch.randn(4, 3)).backward()
    launched = [opt._hvd._next, len(opt._hvd.buckets)]
    opt.step()
    return launched


def _states(hvd: Any) -> dict[str, Any]:
    """Ranks with different weights and optimizer states end with rank 1's."""
    r = hvd.rank()
    model, opt = _make("adam", seed=200 + r)
    for _ in range(r):  # rank 0: empty state; rank k: k steps taken
        _loss(model, torch.randn(4, 5), torch.randn(4, 3)).backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.01 * (r + 1)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=1)
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    state = opt.state_dict()
    # An empty root state empties everyone's (Horovod would fill it with a zero step).
    other, opt2 = _make("adam", seed=300)
    if r != 0:
        _loss(other, torch.randn(4, 5), torch.randn(4, 3)).backward()
        opt2.step()
    hvd.broadcast_optimizer_state(opt2, root_rank=0)
    return {
        "params": [p.tolist() for p in model.parameters()],
        "state": {k: {n: v.tolist() for n, v in s.items()} for k, s in state["state"].items()},
        "lr": state["param_groups"][0]["lr"],
        "empty_root": len(opt2.state),
    }


def _job() -> dict[str, Any]:
    import manygpu.horovod as hvd

    hvd.init()
    try:
        r, n = hvd.rank(), hvd.size()
        return {
            "identity": _identity(hvd),
            "reductions": _reductions(hvd, r),
            "data": _data_moves(hvd, r, n),
            "objects": _objects(hvd, r),
            "train": {v: _train_rank(hvd, v) for v in VARIANTS},
            "states": _states(hvd),
            "overlap": _overlap(hvd),
        }
    finally:
        hvd.shutdown()


# -- expected values -------------------------------------------------------------------
def _check_reductions(results: list[dict[str, Any]], n: int) -> None:
    xs = [[r + 1.0, 2.0 * (r + 1)] for r in range(n)]
    total = [sum(x[i] for x in xs) for i in range(2)]
    mean = [t / n for t in total]
    prod = [1.0, 1.0]
    for x in xs:
        prod = [prod[i] * x[i] for i in range(2)]
    for r, res in enumerate(results):
        out = res["reductions"]
        assert out["avg"] == pytest.approx(mean) and out["input_untouched"] == xs[r]
        assert out["Sum"] == total and out["Min"] == xs[0] and out["Max"] == xs[-1]
        assert out["Product"] == prod
        assert out["int_avg"] == [sum(3 * k + 1 for k in range(n)) // n]
        assert out["average_false"] == total and out["deprecation"]
        assert out["scaled_sum"] == pytest.approx([6 * t for t in total])
        assert out["scaled_avg"] == pytest.approx([6 * m for m in mean])
        assert out["inplace_is_same"] and out["inplace"] == total
        assert out["async"] == pytest.approx(mean) and out["async_input"] == xs[r]
        assert out["async_inplace"] == [True, xs[-1]] and out["sync_again"] is None
        assert out["fp16"][0] == "torch.float32" and out["fp16"][1] == pytest.approx(mean)
        # d/dx of sum_r (r+1) * sum(allreduce_sum(x)): Horovod's gradient is the
        # all-reduce (Sum) of the incoming gradients, (k+1) on rank k.
        assert out["allreduce_grad"] == [n * (n + 1) / 2] * 2
        assert out["grouped"] == [[[n * (n - 1) / 2] * 2] * 2, [n * (n - 1) // 2, n * (n - 1)]]
        assert out["grouped_inplace"] == out["grouped"]
        assert out["grouped_async"] == [pytest.approx(mean), pytest.approx([2 * m for m in mean])]


def _check_data(results: list[dict[str, Any]], n: int) -> None:
    gathered = [[float(r), 10.0 * r] for r in range(n) for _ in range(r + 1)]
    mean_weight = (n + 1) / 2
    for r, res in enumerate(results):
        out = res["data"]
        assert out["allgather"] == gathered
        assert out["allgather_async"] == [[row[0]] for row in gathered]
        assert out["allgather_grad"] == [[mean_weight] * 2] * (r + 1)
        assert out["broadcast"] == [[1.0, 1.5], [r * 1.0, r + 0.5]]
        assert out["broadcast_"] == [n - 1.0, n - 0.5] and out["broadcast_async_"] == [0.0, 0.5]
        assert out["broadcast_grad"] == ([mean_weight] * 2 if r == 1 else [0.0, 0.0])
        assert out["alltoall"] == [j * 100.0 + k for j in range(n) for k in (2 * r, 2 * r + 1)]
        expect, counts = [], []
        for i in range(n):
            start = sum(i + j + 1 for j in range(r))
            counts.append(i + r + 1)
            expect += [i * 1000.0 + start + k for k in range(i + r + 1)]
        assert out["alltoall_splits"] == [expect, counts, "torch.int32"]
        assert out["alltoall_async"] == [expect, counts]
        # alltoall's gradient is the incoming one sent back: rows sent to rank j come
        # back with rank j's weight (j+1).
        assert out["alltoall_grad"] == [float(j + 1) for j in range(n) for _ in range(2)]
        rows = 2 * n + 1
        base = torch.arange(2 * rows, dtype=torch.float32).reshape(rows, 2) * mean_weight
        start = 3 * r if r == 0 else 3 + 2 * (r - 1)  # rank 0 gets the extra row
        count = 3 if r == 0 else 2
        assert _close(out["reducescatter"], base[start : start + count].tolist(), TOL)
        even = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)
        assert out["reducescatter_sum"] == [(even[r] * n * mean_weight).tolist()]
        assert _close(out["reducescatter_async"], [(even[r] * mean_weight).tolist()], TOL)
        # Horovod: Sum's gradient is the all-gather of the gradients times the size.
        assert out["reducescatter_grad"] == [[float(n * (j + 1))] * 2 for j in range(n)]


def _check_identity(results: list[dict[str, Any]], n: int) -> None:
    for r, res in enumerate(results):
        ident = res["identity"]
        assert ident["size"] == n and ident["rank"] == r
        assert ident["local_size"] == n and ident["local_rank"] == r
        assert ident["cross_size"] == 1 and ident["cross_rank"] == 0  # one host
        assert ident["initialized"] and ident["homogeneous"] and ident["gloo_enabled"]
        assert ident["built"][1] is True
        objects = res["objects"]
        assert objects["broadcast_object"] == {"from": 1, "list": [1]}
        assert objects["allgather_object"] == [("rank", k) for k in range(n)]
        assert 0 <= objects["join"] < n
    assert len({res["objects"]["join"] for res in results}) == 1


def _close(a: Any, b: Any, tol: float) -> bool:
    return bool(torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=tol))


def _check_training(results: list[dict[str, Any]]) -> None:
    for variant in VARIANTS:
        want = reference(variant)
        tol = FP16_TOL if variant == "fp16" else TOL
        first = results[0]["train"][variant]
        for r, res in enumerate(results):
            got = res["train"][variant]
            assert got["type"] == [first["type"][0], True], variant
            assert got["unused_grad"] is None, variant
            for name, value in want.items():
                assert _close(got["params"][name], value, tol), (variant, r, name)
                assert got["params"][name] == first["params"][name], (variant, r, name)


def _check_states(results: list[dict[str, Any]]) -> None:
    root = results[1]["states"]
    assert root["lr"] == pytest.approx(0.02)
    assert root["state"], "rank 1 stepped once: it has Adam state"
    assert root["empty_root"] == 0
    for res in results:
        assert res["states"] == root


@pytest.mark.parametrize("world", [2, 3])
def test_every_function_and_training_equals_one_process(world: int) -> None:
    results = run_ranks(_job, world, timeout=240)
    _check_identity(results, world)
    _check_reductions(results, world)
    _check_data(results, world)
    _check_training(results)
    _check_states(results)
    # Every bucket's all-reduce started during backward, none waited for step().
    assert all(res["overlap"] == [4, 4] for res in results)
