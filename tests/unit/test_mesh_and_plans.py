"""Mesh sizes, hybrid resolution, split points and tensor plans: pure checks, no group."""

from __future__ import annotations

import pytest
from jobs import two_rank_cluster
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from manygpu import Parallel, UsageError
from manygpu.core.config import ParallelConfig
from manygpu.strategies import MeshShape, Pipeline
from manygpu.strategies.splitting import balanced_cuts, starts_from_split_points
from manygpu.strategies.tensor.strategy import check_divisible, default_plan, resolve_plan


def test_minus_one_is_inferred() -> None:
    assert MeshShape(dp=2, tp=-1).resolve(8).sizes() == {
        "pp": 1,
        "dp": 2,
        "fsdp": 1,
        "ep": 1,
        "tp": 4,
    }


def test_wrong_product_names_every_factor() -> None:
    with pytest.raises(UsageError, match=r"mesh dp\(2\) \* tp\(4\) = 8 != WORLD_SIZE\(6\)"):
        MeshShape(dp=2, tp=4).resolve(6)


def test_uninferable_size_names_the_others() -> None:
    with pytest.raises(UsageError, match=r"cannot infer mesh size fsdp=-1: pp\(2\) \* tp\(2\)"):
        MeshShape(pp=2, fsdp=-1, tp=2).resolve(6)


@pytest.mark.parametrize(
    "mesh, match",
    [
        ({"dp": -1, "tp": -1}, "only one dimension can be inferred"),
        ({"dp": 0}, "dp=0 must be a positive integer or -1"),
        ({"cp": 2}, "unknown mesh dimension"),
        ({"dp": 1.5}, "must be a positive integer"),
    ],
)
def test_bad_mesh_specs(mesh: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        ParallelConfig(mesh=mesh)  # type: ignore[arg-type]


def test_coords_are_row_major_and_data_rank_ignores_pp_and_tp() -> None:
    spec = MeshShape(pp=2, dp=2, tp=2).resolve(8)
    assert spec.coords(5) == {"pp": 1, "dp": 0, "fsdp": 0, "ep": 0, "tp": 1}
    assert [spec.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert spec.data_size == 2


@pytest.mark.parametrize(
    "mesh, strategy",
    [({"dp": 2}, "ddp"), ({"dp": 2, "fsdp": 2}, "fsdp"), ({"dp": 2, "tp": 2}, "tensor"),
     ({"dp": 2, "pp": 2}, "pipeline"), ({"pp": 2, "tp": 2}, "pipeline"), ({"ep": 4}, "ep"),
     ({"dp": 2, "ep": 2}, "ep")],
)  # fmt: skip
def test_hybrid_picks_the_strategy_that_composes_the_mesh(
    mesh: dict[str, int], strategy: str
) -> None:
    assert ParallelConfig(strategy="hybrid", mesh=mesh).resolved_strategy(4) == strategy
    assert ParallelConfig(mesh=mesh).resolved_strategy(4) == strategy


def test_hybrid_needs_a_mesh() -> None:
    with pytest.raises(UsageError, match="strategy 'hybrid' composes"):
        ParallelConfig(strategy="hybrid")


_LOSS = Pipeline(loss_fn=sum)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"strategy": "tensor", "mesh": {"dp": 2, "tp": 2}}, r"dp\(2\) \* tp\(2\) = 4 != WORLD"),
        ({"strategy": "fsdp", "mesh": {"tp": 2}}, "'fsdp' cannot use mesh dimension.*tp=2"),
        ({"strategy": "ddp", "mesh": {"fsdp": 2}}, "'ddp' cannot use mesh dimension.*fsdp=2"),
        ({"strategy": "single", "mesh": {"dp": 1}}, "'single' takes no mesh"),
        ({"strategy": _LOSS, "mesh": {"pp": 2}, "precision": "fp16"}, "does not scale fp16 losses"),
        ({"strategy": _LOSS, "grad_accum_steps": 2}, r"raise strategy=Pipeline\(microbatches"),
        ({"strategy": "pipeline"}, r"give strategy=Pipeline\(loss_fn=...\)"),
        (
            {"strategy": Pipeline(loss_fn=sum, split_points=(1, 2))},
            r"gives 3 stages but the pipeline has 2 \(mesh pp=2\)",
        ),
        (
            {"strategy": Pipeline(loss_fn=sum, microbatches=1)},
            r"microbatches=1 < 2 stages; raise microbatches or use schedule='gpipe'",
        ),
    ],
)
def test_bad_job_shapes_fail_before_any_group(fields: dict[str, object], match: str) -> None:
    # A 2-process job: validation runs before the rendezvous, so nothing hangs.
    with pytest.raises(UsageError, match=match):
        Parallel(cluster=two_rank_cluster(), **fields)


def test_split_points_are_validated() -> None:
    assert starts_from_split_points([2, 5], layers=7, parts=3) == [0, 2, 5]
    with pytest.raises(UsageError, match="gives 2 stages but the pipeline has 3"):
        starts_from_split_points([2], layers=7, parts=3)
    with pytest.raises(UsageError, match=r"strictly increasing within 1\.\.6"):
        starts_from_split_points([5, 2], layers=7, parts=3)
    with pytest.raises(UsageError, match="cannot split 3 layers into 4 stages"):
        balanced_cuts([1.0, 1.0, 1.0], 4)


def test_time_balance_needs_an_example_input() -> None:
    with pytest.raises(UsageError, match="give example_input"):
        Pipeline(balance="time")


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8) for _ in range(3))
        self.out_proj = nn.Linear(8, 8)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 3)


def test_default_plan_finds_attention_and_mlp_pairs() -> None:
    plan = default_plan(_Block())
    styles = {name: type(style) for name, style in plan.items()}
    assert styles == {
        "attn.q_proj": ColwiseParallel,
        "attn.k_proj": ColwiseParallel,
        "attn.v_proj": ColwiseParallel,
        "attn.out_proj": RowwiseParallel,
        "mlp.0": ColwiseParallel,
        "mlp.2": RowwiseParallel,
    }  # the head (3 outputs) stays replicated


def test_default_plan_needs_something_to_split() -> None:
    with pytest.raises(UsageError, match="found no layers to split"):
        default_plan(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)))


def test_plan_naming_a_missing_module_is_a_clear_error() -> None:
    with pytest.raises(UsageError, match=r"names 'mlp.4'.*Linear layers are: attn.q_proj"):
        resolve_plan(_Block(), {"mlp.0": "colwise", "mlp.4": "rowwise"})
    with pytest.raises(UsageError, match="unknown style 'diagonal'"):
        resolve_plan(_Block(), {"mlp.0": "diagonal"})
    assert set(resolve_plan(_Block(), {"attn.*_proj": "colwise"})) == {"attn.*_proj"}


def test_uneven_split_is_refused() -> None:
    block = _Block()
    with pytest.raises(UsageError, match=r"cannot split 'attn.q_proj' over tp=3: its out_fea"):
        check_divisible(block, default_plan(block), 3)
    with pytest.raises(UsageError, match=r"cannot split 'mlp.2' over tp=3: its in_features \(32"):
        check_divisible(block, {"mlp.2": RowwiseParallel()}, 3)
