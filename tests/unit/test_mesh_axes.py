"""Ratchet: a new mesh axis is one table entry plus one strategy package, nothing else.

tests/helpers/xp_axis adds an ``xp`` axis (between ``fsdp`` and ``tp``, kept
inside a node) and a strategy whose card composes it, from outside the tree,
through the public table and registry. Everything below must then know the
axis: the mesh's sizes and refusals, rank coordinates and the data rank, the
axes the strategy composes, ``strategy="hybrid"`` and the planner. A place that
lists the axes in code instead of reading the table fails here.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from jobs import two_rank_cluster
from torch import nn

import manygpu
from manygpu import Parallel, UsageError
from manygpu.core.config import ParallelConfig
from manygpu.plan.desc import transformer
from manygpu.plan.hardware import preset
from manygpu.plan.recommend import recommend
from manygpu.runtime.process_group import DistContext
from manygpu.strategies import MeshShape, axes, registry
from manygpu.strategies.base import JobOptions
from manygpu.strategies.sharded import MeshStrategy
from manygpu.strategies.spec import StrategySpec

ORDER = ("pp", "dp", "fsdp", "ep", "xp", "tp")
"""The mesh's axes once ``xp`` is added, outermost first."""


@pytest.fixture
def xp(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[StrategySpec]]:
    """The ``xp`` axis and the ``toy-xp`` strategy, for this test only."""
    # Every built-in package registered first: one imported under the patch would
    # register into the copy below and be lost to the tests that run after.
    registry.available()
    monkeypatch.setattr(axes, "_TABLE", list(axes._TABLE))
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "_EXTRA", list(registry._EXTRA))
    monkeypatch.setattr(registry, "_loaded", set(registry._loaded))
    import xp_axis

    registry.add_package("xp_axis")
    yield xp_axis.ExpertSplit
    for name in [m for m in sys.modules if m == "xp_axis" or m.startswith("xp_axis.")]:
        del sys.modules[name]


def test_the_mesh_sizes_and_lays_out_the_new_axis(xp: type[StrategySpec]) -> None:
    assert axes.axis_names() == ORDER
    shape = MeshShape(pp=2, dp=2, xp=2, tp=2).resolve(16)
    sizes = shape.sizes()
    assert sizes == {"pp": 2, "dp": 2, "fsdp": 1, "ep": 1, "xp": 2, "tp": 2}
    # Row-major in the table's order, on a fake world: no process group needed.
    grid = itertools.product(*(range(sizes[n]) for n in ORDER))
    for rank, coords in enumerate(grid):
        assert shape.coords(rank) == dict(zip(ORDER, coords, strict=True))
        # xp splits the model, not the data: ranks differing only on it read alike.
        assert shape.data_rank(rank) == coords[1]
    assert shape.data_size == 2
    assert MeshShape(dp=2, xp=-1).resolve(8).sizes()["xp"] == 4


def test_the_card_says_what_the_strategy_composes(xp: type[StrategySpec]) -> None:
    cls = xp.implementation()
    assert issubclass(cls, MeshStrategy)
    cluster = two_rank_cluster()
    for rank in range(8):
        ctx = DistContext(
            cluster=replace(cluster, rank=rank, world_size=8, local_world_size=8),
            device=torch.device("cpu"),
            backend="gloo",
            timeout_s=10.0,
            owns_group=False,
        )
        strategy = cls(ctx, xp(), JobOptions(mesh=MeshShape(dp=2, xp=-1)))
        assert strategy.mesh_names == ("dp", "fsdp", "xp")
        assert strategy.data_names == ("dp", "fsdp")
        assert strategy.data_shard() == (rank // 4, 2)
        assert repr(strategy).endswith("mesh=dp:2,fsdp:1,xp:4)")


def test_one_process_builds_the_job_mesh_on_the_new_axis(xp: type[StrategySpec]) -> None:
    with Parallel(strategy="toy-xp", device="cpu") as par:
        par.prepare(nn.Linear(2, 2))
        assert par.mesh.mesh_dim_names == ("xp",) and par.mesh.size() == 1


def test_hybrid_picks_the_strategy_whose_card_leads_the_axis(xp: type[StrategySpec]) -> None:
    assert ParallelConfig(mesh={"dp": 2, "xp": 2}).resolved_strategy(4) == "toy-xp"
    assert ParallelConfig(strategy="hybrid", mesh={"xp": -1}).resolved_strategy(4) == "toy-xp"
    # The outermost model axis decides: a pipeline's stages wrap the experts.
    assert ParallelConfig(mesh={"pp": 2, "xp": 2}).resolved_strategy(4) == "pipeline"


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"strategy": "toy-xp", "mesh": {"xp": 4}}, r"^mesh xp\(4\) = 4 != WORLD_SIZE\(2\)"),
        ({"strategy": "toy-xp", "mesh": {"dp": 2, "xp": 2}}, r"dp\(2\) \* xp\(2\) = 4 != WORLD"),
        ({"strategy": "toy-xp", "mesh": {"xp": -1, "dp": 3}}, r"infer mesh size xp=-1: dp\(3\)"),
        ({"strategy": "toy-xp", "mesh": {"tp": 2}}, r"'toy-xp' cannot use .*tp=2; it takes dp, f"),
        ({"strategy": "fsdp", "mesh": {"xp": 2}}, r"'fsdp' cannot use mesh dimension\(s\) xp=2"),
        ({"strategy": "ddp", "mesh": {"xp": 2}}, r"'ddp' cannot use mesh dimension\(s\) xp=2"),
        ({"mesh": {"xp": 0}}, r"mesh size xp=0 must be a positive integer"),
        ({"mesh": {"zz": 2}}, r"'zz'; choose from pp, dp, fsdp, ep, xp, tp$"),
    ],
)
def test_a_bad_size_is_one_line_naming_the_new_axis(
    xp: type[StrategySpec], fields: dict[str, object], match: str
) -> None:
    with pytest.raises(UsageError, match=match) as info:
        Parallel(cluster=two_rank_cluster(), **fields)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_the_planner_tries_the_axis_within_a_node(xp: type[StrategySpec]) -> None:
    desc = transformer("t", parameters=10**9, layers=16, hidden=2048, seq_len=512)
    plan = recommend(desc, preset("h100", nodes=2), batch=1, precision="bf16")
    ours = {c.ways: c.recipe for c in plan.candidates if c.strategy == "toy-xp"}
    assert sorted(ours) == [2, 4, 8]  # 16 is a divisor of the world but spans two nodes
    recipe = ours[2]
    assert recipe.layout() == "dp 8 x xp 2"
    line = recipe.parallel_line()
    assert 'mesh={"dp": 8, "xp": 2}' in line
    names = {n: getattr(manygpu, n) for n in manygpu.__all__} | {"Parallel": ParallelConfig}
    config = eval(line, names | {"ExpertSplit": xp})
    assert config.resolved_strategy(16) == "toy-xp"
    assert config.mesh.sizes()["xp"] == 2


def test_the_axis_is_gone_with_its_package() -> None:
    """The fixture restores the table: no other test sees ``xp``."""
    assert "xp" not in axes.axis_names()
    with pytest.raises(UsageError, match="unknown mesh dimension"):
        MeshShape.parse({"xp": 2})
