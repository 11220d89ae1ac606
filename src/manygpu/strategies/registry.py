"""The strategies, by name: one line per strategy package, each registering its object.

A strategy is a package under ``strategies/`` whose ``__init__`` defines its
object (a :class:`~.spec.StrategySpec`: its options, and its card as data on
the class) and registers it with :func:`register`; adding one is its folder
plus its line in :data:`OBJECTS`. The planner's candidates, ``"auto"``'s
choices, the default strategy and the checkpoint format all derive from the
cards, so no code outside ``strategies/`` branches on a name. The class that
does the work is imported only when it is looked up: FSDP, DTensor and
pipelining are loaded by the jobs that use them, not by every ``import manygpu``.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from manygpu.errors import UsageError
from manygpu.strategies.axes import axis_names, deciding_axis, is_axis
from manygpu.strategies.costs import CommModel, MemoryModel

if TYPE_CHECKING:
    from manygpu.checkpoint_io.formats import Format
    from manygpu.strategies.base import Strategy
    from manygpu.strategies.mesh import MeshShape
    from manygpu.strategies.spec import StrategySpec

    T = TypeVar("T", bound=type[StrategySpec])

Ways = Literal["one", "local_devices", "axis", "servers", "never"]


@dataclass(frozen=True, kw_only=True)
class StrategyCard:
    """What is known of a strategy without importing it."""

    simplicity: int
    """Tie-break rank when the planner finds two equally fast: fewer moving parts first."""
    changes_loop: bool
    """Needs options or a loop the user must write for it (a loss function, a
    plan, outputs on another device): ``"auto"`` never picks it silently."""
    checkpoint: Format
    """``FULL``: one copy from the main rank (replicated state); ``DCP``: shards."""
    memory: MemoryModel
    comm: CommModel
    one_process: bool
    """One process drives every device it uses (a candidate for a one-process job)."""
    plan_ways: Ways
    """Model-split sizes the planner tries: none (``one``), 2..GPUs of a node
    (``local_devices``), divisors of the world on the mesh axis ``ways_option``
    names (``axis``: within a node when the axis stays inside one), server counts
    (``servers``: 1, 2, 4... up to half the world); ``never``: not a planner candidate."""
    ways_option: str = ""
    """How a user asks for the planner's ways: a mesh axis (``"tp"``, ``"pp"``;
    the rest of the world on the replica axis) or an option of the strategy's object
    (``"servers"``, ``"stages"``); empty when it has no ways."""
    mesh_axes: tuple[str, ...] | Literal["all"] = ()
    """The mesh axes it composes, outermost first (a mesh sizing any other is
    refused); ``"all"``: every axis of the table (the user's plan uses them);
    empty: it takes no mesh."""
    mesh_default: str = ""
    """The axis that takes every rank when the job gives no mesh (``"fsdp"``);
    empty: it runs without a mesh unless one is given."""
    hybrid_for: str = ""
    """The axis it composes for ``strategy="hybrid"``: a mesh whose deciding axis
    this is (see :func:`~.axes.deciding_axis`) picks it. One strategy per axis."""
    required_options: tuple[str, ...] = ()
    """Options its object cannot train without, shown in the planner's
    ``Parallel(...)`` line for the user to fill in (``"loss_fn=..."``)."""
    serves: bool = False
    """Its first ranks serve the others (parameter servers): ``manygpu launch
    --ps K`` picks it when the script names no strategy."""
    name: str = ""
    """Set by :func:`register` from the strategy's object."""

    def axes(self) -> tuple[str, ...]:
        """The mesh axes it composes, outermost first (``"all"``: the table's, now)."""
        return axis_names() if self.mesh_axes == "all" else self.mesh_axes

    def plan_axis(self) -> str | None:
        """The mesh axis its planner ways go on (``ways_option``), or ``None``."""
        return self.ways_option if is_axis(self.ways_option) else None


OBJECTS: dict[str, str] = {
    "Single": "single",
    "DDP": "ddp",
    "Zero1": "ddp",
    "FSDP": "fsdp",
    "Zero2": "fsdp",
    "ModelParallel": "model",
    "Tensor": "tensor",
    "Pipeline": "pipeline",
    "DataParallel": "dp",
    "PS": "ps",
    "Parallelize": "parallelize",
    "ExpertParallel": "expert",
}
"""Every strategy object a user imports, by the package under ``manygpu.strategies``
that defines and registers it: the one list of strategies. ``manygpu`` and
``manygpu.strategies`` export these names from it (lazily), and the packages are
imported from it on the first lookup."""
PACKAGES: tuple[str, ...] = tuple(dict.fromkeys(OBJECTS.values()))
"""Every strategy package under ``manygpu.strategies``, in :data:`OBJECTS`' order."""
_EXTRA: list[str] = []
"""Packages elsewhere added by :func:`add_package` (a user's or a test's own strategy)."""
_SPECS: dict[str, type[StrategySpec]] = {}
_loaded: set[str] = set()


def register(cls: T) -> T:
    """Class decorator for a strategy's object: known by ``cls.name`` from now on."""
    name = cls.name
    if name in _SPECS and _SPECS[name] is not cls:
        raise ValueError(f"strategy {name!r} is registered twice: {_SPECS[name]} and {cls}")
    cls.card = replace(cls.card, name=name)
    _SPECS[name] = cls
    return cls


def preset(title: str, base: T, *, name: str, card: StrategyCard, **options: Any) -> T:
    """A registry entry that is ``base``'s object with ``options`` fixed (Fabric's registry
    line: a name, a class and its options), under its own ``name`` and ``card``:
    ``Zero2 = preset("Zero2", FSDP, name="zero2", card=..., reshard_after_forward=False)``.

    The object it makes keeps that name, so ``Zero2(param_dtype="bf16")`` reads,
    compares and is saved in checkpoints as before; the fixed options are not its
    arguments. The class doing the work is ``base``'s, told this entry's name and card.
    """
    kinds = {f.name: f.type for f in fields(base)}
    fixed = [(k, kinds[k], field(default=v, init=False, repr=False)) for k, v in options.items()]

    made_work: list[type[Strategy[Any]]] = []  # one class, made on the first lookup

    def implementation(cls: type[StrategySpec]) -> type[Strategy[Any]]:
        if not made_work:
            made_work.append(_preset_work(base.implementation(), cls))
        return made_work[0]

    made = make_dataclass(
        title, fixed, bases=(base,), frozen=True, kw_only=True,
        namespace={"name": name, "card": card, "implementation": classmethod(implementation),
                   "__module__": base.__module__,
                   "__doc__": f"``{base.__name__}`` with {options} (registered as {name!r})."},
    )  # fmt: skip
    return register(made)  # type: ignore[return-value]


def _preset_work(work: type[Strategy[Any]], spec: type[StrategySpec]) -> type[Strategy[Any]]:
    """``work`` under a preset's name and card (``Zero2Strategy``: ``FSDPStrategy`` as zero2)."""
    ns = {"spec_class": spec, "__module__": work.__module__, "__doc__": spec.__doc__}
    return type(f"{spec.__name__}Strategy", (work,), ns)


def add_package(module: str) -> None:
    """Register the strategies a package outside manygpu defines (it calls :func:`register`)."""
    if module not in _EXTRA:
        _EXTRA.append(module)


def _specs() -> dict[str, type[StrategySpec]]:
    for module in [*(f"manygpu.strategies.{p}" for p in PACKAGES), *_EXTRA]:
        if module not in _loaded:
            importlib.import_module(module)
            _loaded.add(module)
    return _SPECS


def available() -> list[str]:
    """Registered strategy names, sorted."""
    return sorted(_specs())


def cards() -> tuple[StrategyCard, ...]:
    """Every card, simplest first."""
    return tuple(sorted((s.card for s in _specs().values()), key=lambda c: c.simplicity))


def spec_class(name: str) -> type[StrategySpec]:
    """The object registered as ``name``; a clear error for unknown names."""
    try:
        return _specs()[name]
    except KeyError:
        raise UsageError(unknown_name(name)) from None


def unknown_name(name: object) -> str:
    """One line for a name that is no strategy: the nearest one, then every choice."""
    names = sorted([*available(), "hybrid", "auto"])
    close = difflib.get_close_matches(str(name).lower(), names, n=1, cutoff=0.6)
    hint = f" did you mean {close[0]!r}?" if close else ""
    return f"unknown strategy {name!r};{hint} choose one of: {', '.join(names)}"


def card(name: str) -> StrategyCard:
    """The card of ``name``; a clear error for unknown names."""
    return spec_class(name).card


def get_strategy(name: str) -> type[Strategy[Any]]:
    """The class that does the work of ``name``, imported now."""
    return spec_class(name).implementation()


HYBRID, AUTO = "hybrid", "auto"
RULES = (HYBRID, AUTO)
"""Names that are rules, not strategies: the one that composes the mesh's dimensions,
and the planner's pick once the model is known."""


def check_name(name: str | None, has_mesh: bool) -> None:
    """Refuse, in one line, a strategy name that is neither registered nor a rule that fits."""
    if name == HYBRID and not has_mesh:
        raise UsageError(
            "strategy 'hybrid' composes the dimensions of a mesh: give one, "
            "e.g. mesh={'dp': 2, 'tp': -1}"
        )
    if name not in (None, HYBRID, AUTO):
        spec_class(name)  # raises with the list of names


def strategy_for_mesh(shape: MeshShape) -> str:
    """The strategy that composes the axes a mesh asks for (``strategy="hybrid"``): the
    one whose card is ``hybrid_for`` the mesh's deciding axis."""
    decides = deciding_axis(shape.sizes())
    leads = [c.name for c in cards() if c.hybrid_for == decides]
    if len(leads) != 1:
        raise UsageError(
            f"strategy='hybrid' needs one strategy whose card composes mesh dimension "
            f"{decides!r} (hybrid_for), found {leads or 'none'}; name the strategy"
        )
    return leads[0]


def resolve_name(name: str | None, mesh: MeshShape | None, world_size: int, served: bool) -> str:
    """The registered strategy a name (or no name) stands for in a job of ``world_size``.

    ``"hybrid"`` (or no name with a mesh): the strategy composing the mesh; no name
    under ``manygpu launch --ps K`` (``served``): the serving one; ``"auto"``: the
    default until the planner has seen the model.
    """
    if name not in (None, HYBRID, AUTO):
        return name
    if name != AUTO and mesh is not None:
        return strategy_for_mesh(mesh)
    if served and name is None:
        return serving_strategy()
    return default_strategy(world_size)


def default_strategy(world_size: int) -> str:
    """What runs when none is named: the simplest unchanged loop for this many processes."""
    fits = [c for c in cards() if not c.changes_loop and c.plan_ways != "never"]
    return next(c.name for c in fits if c.one_process == (world_size == 1))


def serving_strategy() -> str:
    """The strategy whose first ranks serve the others (what ``--ps K`` launches)."""
    return next(c.name for c in cards() if c.serves)
