"""A strategy is an object that carries its options, and a new one is one package.

``Parallel(strategy=DDP(bucket_cap_mb=5))`` reaches torch's DDP; the string is
the defaults' shorthand; the old per-strategy keywords are refused in one line
naming the object that replaced each. The ratchets: the base interface does not
grow, and a strategy defined outside manygpu (a test's temporary package) plugs
in through one registry call, touching no manygpu file.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from manygpu import (
    DDP,
    FSDP,
    PS,
    Parallel,
    ParallelConfig,
    Parallelize,
    Pipeline,
    Tensor,
)
from manygpu.errors import UsageError
from manygpu.strategies import (
    Strategy,
    StrategySpec,
    Zero1,
    Zero2,
    available,
    card,
    get_strategy,
    registry,
    spec_class,
)
from manygpu.strategies.sharded import MeshStrategy

MB = 1024 * 1024


def _bucket_cap(par: Parallel) -> int:
    model = par.prepare(nn.Linear(4, 4))
    return int(model.bucket_bytes_cap)  # type: ignore[arg-type]


def test_the_object_s_options_reach_torch() -> None:
    chosen = DDP(bucket_cap_mb=5)
    with Parallel(strategy=chosen, device="cpu") as par:
        assert par.strategy_name == "ddp" and par.strategy.options is chosen
        assert _bucket_cap(par) == 5 * MB


def test_a_name_is_the_object_with_its_defaults() -> None:
    with Parallel(strategy="ddp", device="cpu") as par:
        assert par.strategy.options == DDP()
        assert _bucket_cap(par) == 25 * MB


def test_the_object_given_is_used_and_another_name_is_its_defaults() -> None:
    """``"auto"`` may switch to another strategy: that one runs with its defaults."""
    given = Tensor(plan={"fc": "colwise"}, fsdp=FSDP(param_dtype="bf16"))
    config = ParallelConfig(strategy=given)
    assert config.strategy_object("tensor") is given
    assert config.strategy_object("zero1") == Zero1()
    assert config.strategy_object("zero2") == Zero2()
    assert config.strategy_object("pipeline") == Pipeline()
    assert config.strategy_object("ps") == PS()


REMOVED = {
    "ddp": r"strategy=DDP\(\.\.\.\)",
    "fsdp": r"strategy=FSDP\(\.\.\.\)",
    "model_stages": r"strategy=ModelParallel\(stages=\.\.\.\)",
    "pipeline": r"strategy=Pipeline\(\.\.\.\)",
    "tensor": r"strategy=Tensor\(\.\.\.\)",
    "ps": r"strategy=PS\(\.\.\.\)",
}


@pytest.mark.parametrize("keyword", sorted(REMOVED))
def test_a_removed_keyword_is_one_line_naming_its_object(keyword: str) -> None:
    """The per-strategy keywords never shipped in a release; a script still using one
    is told, in one line, which object replaces it (from either door)."""
    for make in (Parallel, ParallelConfig):
        with pytest.raises(UsageError, match=rf"^Parallel\({keyword}=\.\.\.\) was removed: use "
                           + REMOVED[keyword] + "$") as info:  # fmt: skip
            make(strategy="ddp", device="cpu", **{keyword: 1})
        assert "\n" not in str(info.value)


def test_a_misspelt_keyword_is_one_line_with_the_nearest_one() -> None:
    """Every other typo gets "did you mean"; a keyword was a bare TypeError."""
    for make in (Parallel, ParallelConfig):
        wanted = r"^Parallel takes no keyword presicion=; did you mean precision=\? it takes: "
        with pytest.raises(UsageError, match=wanted + "strategy, precision, ") as info:
            make(presicion="bf16")
        assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match=r"^Parallel takes no keyword zzz=; it takes: "):
        Parallel(zzz=1)  # nothing near: the choices only


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"strategy": DDP}, r"strategy=DDP is the class: give an object, strategy=DDP\(\)"),
        ({"strategy": 3}, "strategy takes a name"),
        (
            {"strategy": "fdsp"},
            r"unknown strategy 'fdsp'; did you mean 'fsdp'\? choose one of: auto",
        ),
        ({"strategy": "parallelize"}, r"needs your plan: give strategy=Parallelize\(fn\)"),
    ],
)
def test_a_wrong_strategy_is_one_line(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError, match=needle) as info:
        ParallelConfig(**fields)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_every_strategy_object_is_registered_by_its_name() -> None:
    for name in available():
        spec = spec_class(name)
        assert spec.name == name and spec.card.name == name
        assert spec.implementation().spec_class is spec
        made = spec(print) if spec is Parallelize else spec()  # type: ignore[call-arg]
        assert ParallelConfig(strategy=made).resolved_strategy(2) == name


# -- ratchets -----------------------------------------------------------------------

HOOKS_TODAY = 10
"""Methods of the base interface a strategy may override; the number may only fall
(what only some strategies do is an ability in :mod:`manygpu.strategies.abilities`)."""


def _hooks() -> list[str]:
    own = {**vars(Strategy), **vars(MeshStrategy)}
    callable_ = (inspect.isfunction, lambda v: isinstance(v, classmethod | property))
    return sorted(
        n for n, v in own.items() if not n.startswith("__") and any(f(v) for f in callable_)
    )


def test_the_base_interface_does_not_grow() -> None:
    hooks = _hooks()
    assert len(hooks) <= HOOKS_TODAY, (
        f"Strategy has {len(hooks)} hooks ({', '.join(hooks)}), more than {HOOKS_TODAY}: "
        "give the new ability its own small protocol that Parallel asks for by capability"
    )


FLAGS_TODAY = 15
"""Class-level flags (``ClassVar`` attributes: ``needs_process_group``, ``mesh_dims``...)
of the base interface (``Strategy``, ``MeshStrategy``, ``StrategySpec``); the number
may only fall. A flag is a hook in disguise: each one is a question Parallel asks."""
OWN_FLAGS_TODAY = {"fp8_all_gather"}
"""Class-level flags a strategy, its object or an ability it mixes in adds beyond the
base's; the set may only shrink. A choice a user makes is an option (a field of the
object), a preset of options is a registry entry, what only some strategies do is an
ability in :mod:`manygpu.strategies.abilities`."""


def _flags(cls: type) -> set[str]:
    """The class-level data ``cls`` itself defines: ``ClassVar`` annotations and plain
    values, not methods, dataclass fields' defaults or Python's own (``_abc_impl``)."""
    notes = inspect.get_annotations(cls)
    own = {n for n, a in notes.items() if str(a).startswith("ClassVar")}
    methods = (inspect.isfunction, lambda v: isinstance(v, classmethod | staticmethod | property))
    own |= {n for n, v in vars(cls).items() if not any(f(v) for f in methods)}
    if dataclasses.is_dataclass(cls):
        own -= {f.name for f in dataclasses.fields(cls)}
    return {n for n in own if not n.startswith("_")}


def test_the_class_level_flags_do_not_grow() -> None:
    bases = (Strategy, MeshStrategy, StrategySpec)
    base = set().union(*(_flags(c) for c in bases))
    assert len(base) <= FLAGS_TODAY, (
        f"the base interface has {len(base)} class-level flags ({', '.join(sorted(base))}), "
        f"more than {FLAGS_TODAY}: ask for the new ability by capability instead"
    )
    own: dict[str, set[str]] = {}
    for name in available():
        for cls in (*get_strategy(name).__mro__, *spec_class(name).__mro__):
            if cls not in (*bases, object):
                for flag in _flags(cls) - base:
                    own.setdefault(flag, set()).add(cls.__qualname__)
    new = {f: sorted(c) for f, c in own.items() if f not in OWN_FLAGS_TODAY}
    assert not new, (
        f"new class-level flags {new}: make a user's choice an option of the strategy's "
        "object, a preset of options a registry entry, and what only some strategies do "
        "an ability (manygpu.strategies.abilities)"
    )


TOY_SPEC = """
from dataclasses import dataclass
from typing import ClassVar

from manygpu.checkpoint_io.formats import FULL
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec


@register
@dataclass(frozen=True, kw_only=True)
class Halve(StrategySpec):
    name: ClassVar[str] = "toy-halve"
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=99, changes_loop=True, checkpoint=FULL, memory=MemoryModel(),
        comm=CommModel(replica="one_process", grads="none"), one_process=True,
        plan_ways="never",
    )
    factor: float = 0.5

    @classmethod
    def implementation(cls):
        from toy_strategy.work import HalveStrategy

        return HalveStrategy
"""

TOY_WORK = """
from manygpu.strategies.base import Strategy
from toy_strategy import Halve


class HalveStrategy(Strategy[Halve]):
    spec_class = Halve

    def setup_module(self, module, place):
        return place(module, self.ctx.device)

    def backward(self, loss):
        (loss * self.options.factor).backward()
"""


@pytest.fixture
def toy_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A strategy in a package outside manygpu, registered for this test only."""
    pkg = tmp_path / "toy_strategy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(TOY_SPEC)
    (pkg / "work.py").write_text(TOY_WORK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "_EXTRA", list(registry._EXTRA))
    monkeypatch.setattr(registry, "_loaded", set(registry._loaded))
    yield "toy_strategy"
    for name in [m for m in sys.modules if m.startswith("toy_strategy")]:
        del sys.modules[name]


def test_a_new_strategy_is_its_own_package_and_one_registry_call(toy_package: str) -> None:
    registry.add_package(toy_package)
    assert "toy-halve" in available()
    model = nn.Linear(3, 1)
    x = torch.ones(2, 3)
    with Parallel(strategy="toy-halve", device="cpu") as par:
        prepared = par.prepare(model)
        par.backward(prepared(x).sum())
        assert par.strategy_name == "toy-halve"
    assert model.weight.grad is not None
    assert torch.equal(model.weight.grad, torch.full((1, 3), 1.0))  # 2 rows x 1, halved
    halve = spec_class("toy-halve")
    with Parallel(strategy=halve(factor=0.25), device="cpu") as par:  # type: ignore[call-arg]
        model.weight.grad = None
        par.backward(par.prepare(model)(x).sum())
    assert torch.equal(model.weight.grad, torch.full((1, 3), 0.5))


def test_a_preset_is_one_registry_line(toy_package: str) -> None:
    """``Zero2`` is ``FSDP`` with an option fixed, registered under its own name and card;
    a new preset is one :func:`~manygpu.strategies.registry.preset` call, no class."""
    from manygpu.strategies.base import given_repr

    assert Zero2(param_dtype="bf16") == Zero2(param_dtype="bf16") != FSDP(param_dtype="bf16")
    assert Zero2().reshard_after_forward is False and FSDP().reshard_after_forward is True
    assert given_repr(Zero2(param_dtype="bf16")) == "Zero2(param_dtype='bf16')"
    assert get_strategy("zero2").__mro__[1] is get_strategy("fsdp")
    assert get_strategy("zero2").name == "zero2" and card("zero2").simplicity == 3
    with pytest.raises(TypeError, match="reshard_after_forward"):
        Zero2(reshard_after_forward=True)  # type: ignore[call-arg]
    big = registry.preset(
        "BigBuckets", DDP, name="toy-big-buckets", card=card("ddp"), bucket_cap_mb=100.0
    )
    with Parallel(strategy="toy-big-buckets", device="cpu") as par:
        assert par.strategy.options == big() and _bucket_cap(par) == 100 * MB
        assert repr(par.strategy) == "BigBucketsStrategy(BigBuckets())"


def test_a_replicating_job_has_a_one_dimensional_data_mesh() -> None:
    with Parallel(strategy="ddp", device="cpu") as par:
        assert par.mesh.mesh_dim_names == ("dp",) and par.mesh.size() == 1
        assert par.mesh is par.mesh
        assert par.reduce(torch.tensor([3.0]), "sum", over="dp").item() == 3.0
        with pytest.raises(UsageError, match=r"reduce\(over='tp'\): this job's mesh has dime"):
            par.reduce(torch.tensor([3.0]), over="tp")
    with (
        Parallel(strategy="single", device="cpu") as par,
        pytest.raises(UsageError, match="one process without a process group: it has no"),
    ):
        par.mesh  # noqa: B018


def test_the_user_s_plan_gets_the_job_s_mesh_and_a_wrong_one_is_one_line() -> None:
    seen: list[object] = []

    def plan(model: nn.Module, mesh: object) -> None:
        seen.append(mesh)

    with Parallel(strategy=Parallelize(plan), device="cpu") as par:
        par.prepare(nn.Linear(2, 2))
        assert seen == [par.mesh] and par.mesh.mesh_dim_names == ("fsdp",)
    with (
        Parallel(strategy=Parallelize(lambda model, mesh: 3), device="cpu") as par,
        pytest.raises(UsageError, match="fn returned a int: return the model"),
    ):
        par.prepare(nn.Linear(2, 2))
    with pytest.raises(UsageError, match=r"Parallelize needs your plan: Parallelize\(fn\)"):
        Parallelize(None)  # type: ignore[arg-type]


def test_a_strategy_reads_as_its_options_and_mesh() -> None:
    """``repr(par.strategy)`` names the class, the options given and the mesh it composes,
    not an object address; defaults are left out."""
    with Parallel(strategy=DDP(bucket_cap_mb=50)) as par:
        assert repr(par.strategy) == "DDPStrategy(DDP(bucket_cap_mb=50))"
    with Parallel(strategy=FSDP(param_dtype="bf16")) as par:
        assert repr(par.strategy) == "FSDPStrategy(FSDP(param_dtype='bf16'), mesh=fsdp:1)"
    with Parallel(strategy="ddp") as par:
        assert repr(par.strategy) == "DDPStrategy(DDP())"
