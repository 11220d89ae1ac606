"""``"tensor"`` (an MLP and a transformer block), dp x tp, and HSDP match one process.

Tolerance: max |difference| < 1e-5 in fp32 for every parameter after k SGD
steps with momentum (tensor parallel splits the matmuls' sums, so only
rounding differs), and the per-step losses agree to 1e-5. Not Adam: the key
bias's true gradient is zero (softmax ignores a constant shift), and Adam
would blow its rounding noise up to full-size steps.

The cases run in two jobs, one start of 2 ranks and one of 4 (module fixtures): each
case's ``Parallel`` borrows the job's process group, and the tests read their case.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

from manygpu import Parallel
from manygpu.strategies import Tensor

TOL = 1e-5
STEPS, BATCH, SEQ, DIM, HEADS = 3, 4, 5, 16, 4


class Block(nn.Module):
    """Pre-norm transformer block; heads come from the tensor (each tp rank has 1/tp)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.out_proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (
            proj(h).view(b, t, -1, DIM // HEADS).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(att.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def make(kind: str) -> nn.Module:
    torch.manual_seed(99)
    if kind == "block":
        return Block()
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 3))


def data(kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    shape = (n, SEQ, DIM) if kind == "block" else (n, DIM)
    target = (n, SEQ, 3) if kind == "block" else (n, 3)
    return torch.randn(shape, generator=gen), torch.randn(target, generator=gen)


def reference(kind: str, shards: int) -> dict[str, object]:
    model = make(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = data(kind, STEPS * BATCH * shards)
    glob, losses = BATCH * shards, []
    for step in range(STEPS):
        s = slice(step * glob, (step + 1) * glob)
        loss = nn.functional.mse_loss(model(x[s]), y[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach() for k, v in model.state_dict().items()}}


def _train(kind: str, strategy: str, mesh: dict[str, int], plan: object) -> dict[str, object]:
    chosen = Tensor(plan=plan) if plan is not None else strategy  # type: ignore[arg-type]
    par = Parallel(strategy=chosen, mesh=mesh)
    try:
        model = par.prepare(make(kind))
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        shard, shards = par.strategy.data_shard()
        x, y = data(kind, STEPS * BATCH * shards)
        losses = []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step in range(STEPS):
                start = (step * shards + shard) * BATCH
                out = model(x[start : start + BATCH])
                loss = nn.functional.mse_loss(out, y[start : start + BATCH])
                par.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(par.reduce(loss).item())
        local = {k: _local(p) for k, p in par.unwrap(model).named_parameters()}
        full = {k: _full(v) for k, v in par.unwrap(model).state_dict().items()}
        views = [str(w.message) for w in said if "returned a view tensor" in str(w.message)]
        return {"losses": losses, "params": full, "local": local, "views": views}
    finally:
        par.close()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _local(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


def _check(results: list[dict[str, object]], ref: dict[str, object]) -> None:
    for out in results:
        assert out["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert out["params"].keys() == ref["params"].keys()
        for key, value in ref["params"].items():
            assert (out["params"][key] - value).abs().max().item() < TOL, key


def _jobs(calls: list[tuple[Any, ...]]) -> list[Any]:
    """Several cases on this rank in one process start, each ``Parallel`` borrowing one
    process group (re-creating groups on one port back to back races the rendezvous)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    run = {"train": _train, "mesh": _mesh_facts}
    return [run[what](*args) for what, *args in calls]


PLAN = {"0": "colwise", "2": "rowwise"}
JOBS: dict[int, dict[str, tuple[Any, ...]]] = {
    2: {
        "tensor-mlp": ("train", "mlp", "tensor", {"tp": -1}, None),
        "tensor-block": ("train", "block", "tensor", {"tp": -1}, None),
        "user-plan": ("train", "mlp", "tensor", {"tp": 2}, PLAN),
    },
    4: {
        "tensor-block": ("train", "block", "tensor", {"tp": -1}, None),
        "hybrid-block": ("train", "block", "hybrid", {"dp": 2, "tp": 2}, None),
        "hybrid-mlp": ("train", "mlp", "hybrid", {"dp": 2, "tp": 2}, None),
        "hsdp": ("train", "mlp", "fsdp", {"dp": 2, "fsdp": -1}, None),
        "mesh": ("mesh",),
    },
}


def _run_job(world: int) -> dict[str, list[Any]]:
    results = run_ranks(_jobs, world, list(JOBS[world].values()), timeout=170)
    return {name: [ranks[i] for ranks in results] for i, name in enumerate(JOBS[world])}


@pytest.fixture(scope="module")
def two() -> dict[str, list[Any]]:
    """Every 2-rank case's per-rank results, by case name."""
    return _run_job(2)


@pytest.fixture(scope="module")
def four() -> dict[str, list[Any]]:
    """Every 4-rank case's per-rank results, by case name."""
    return _run_job(4)


@pytest.mark.parametrize("kind, world", [("mlp", 2), ("block", 2), ("block", 4)])
def test_tensor_parallel_matches_one_process(
    kind: str, world: int, request: pytest.FixtureRequest
) -> None:
    results = request.getfixturevalue({2: "two", 4: "four"}[world])[f"tensor-{kind}"]
    _check(results, reference(kind, 1))
    # Split layers hold 1/tp of their weights on each rank; the head is replicated.
    weight = "mlp.0.weight" if kind == "block" else "0.weight"
    numel = (4 * DIM if kind == "block" else 32) * DIM
    assert results[0]["local"][weight] == numel // world
    assert results[0]["local"]["head.weight" if kind == "block" else "2.bias"] == 3 * (
        DIM if kind == "block" else 1
    )


def test_user_plan_on_the_mlp(two: dict[str, list[Any]]) -> None:
    _check(two["user-plan"], reference("mlp", 1))  # PLAN: colwise then rowwise


@pytest.mark.parametrize("kind", ["block", "mlp"])
def test_dp2_x_tp2_matches_the_global_batch(kind: str, four: dict[str, list[Any]]) -> None:
    """And quietly: the mlp's root (an FSDP2 unit) returns its row-parallel layer's
    output, which must not be a view of the layer's DTensor shard (FSDP2 warns)."""
    results = four[f"hybrid-{kind}"]
    _check(results, reference(kind, 2))
    assert all(out["views"] == [] for out in results), results[0]["views"]


def test_hsdp_replicates_across_and_shards_within(four: dict[str, list[Any]]) -> None:
    results = four["hsdp"]
    _check(results, reference("mlp", 4))  # all 4 ranks read different data
    # Sharded over fsdp=2 only: each rank holds half of a weight, not a quarter.
    assert results[0]["local"]["0.weight"] == 32 * DIM // 2


def _mesh_facts() -> dict[str, object]:
    par = Parallel(strategy="tensor", mesh={"dp": 2, "tp": 2})
    try:
        par.prepare(make("mlp"))  # the strategy shards over the job's mesh
        mesh = par.mesh
        mine = torch.tensor([float(par.rank)])
        return {
            "names": mesh.mesh_dim_names,
            "one_mesh": mesh is par.mesh and len(par.strategy.ctx.meshes) == 1,
            "tp": par.reduce(mine, "sum", over="tp").item(),
            "dp": par.reduce(mine, "sum", over="dp").item(),
            "all": par.reduce(mine, "sum").item(),
            "data_index": mesh.get_local_rank("dp"),
        }
    finally:
        par.close()


def test_the_job_owns_one_mesh_and_reduces_over_its_dimensions(
    four: dict[str, list[Any]],
) -> None:
    """Ranks are laid out row-major (rank = dp_i * 2 + tp_i): the tp group of rank r is
    {2(r//2), 2(r//2)+1}, its dp group {r%2, r%2+2}. dp x tp composes FSDP2 over the data
    dimensions as HSDP with shards of one rank, hence the fsdp dimension of size 1."""
    facts = four["mesh"]
    for rank, got in enumerate(facts):
        assert got["names"] == ("dp", "fsdp", "tp") and got["one_mesh"], got
        assert got["tp"] == 4 * (rank // 2) + 1, (rank, got)
        assert got["dp"] == 2 * (rank % 2) + 2, (rank, got)
        assert got["all"] == 6 and got["data_index"] == rank // 2, (rank, got)
