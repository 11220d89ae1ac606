"""The code's shape, guarded: one home per concept, one-way layers, small files.

Each rule here is a habit of STYLE.md that drifted once; the failure message
names the file, the line and what to do instead.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from manygpu.strategies import available, card, get_strategy
from manygpu.strategies.axes import axis_names
from manygpu.strategies.base import Strategy
from manygpu.strategies.registry import PACKAGES

SRC = Path(__file__).resolve().parents[2] / "src" / "manygpu"
FILES = sorted(SRC.rglob("*.py"))

# Lowest first; a module may import its own layer or lower ones. Longest prefix wins.
LAYERS: dict[str, int] = {
    "manygpu.errors": 0,
    "manygpu.warn": 0,
    "manygpu.flags": 0,
    "manygpu._lazy": 0,
    "manygpu._version": 0,
    "manygpu.runtime": 1,
    "manygpu.comm": 2,
    "manygpu.emulate": 2,
    # How state reaches disk: below the strategies, which name their format.
    "manygpu.checkpoint_io": 3,
    # Weights into and out of a (sharded) model as safetensors: beside checkpoint_io.
    "manygpu.weights": 3,
    # Model transforms (blocks, activation checkpointing, channels_last, fp8): below
    # the strategies, which find blocks and declare the fp8 ability with them.
    "manygpu.transforms": 3,
    "manygpu.strategies": 4,
    "manygpu.plan": 5,
    "manygpu.tracking": 5,  # experiment trackers under Parallel.log: below core, which uses them
    # Observability (step clock, straggler board and rules, profiling, par.log): parts
    # Parallel is built from, above the trackers they write to.
    "manygpu.observe": 6,
    "manygpu.core": 7,
    "manygpu.checkpoint": 8,
    "manygpu.launch": 8,
    "manygpu.doctor": 8,
    "manygpu.demo": 8,
    "manygpu.bench": 8,
    "manygpu.k8s": 8,  # manifests for Kubernetes operators: plain data, beside launch/
    "manygpu.horovod": 8,  # Horovod's API on runtime/ and comm/, imported only when asked
    "manygpu.ray": 8,  # Ray Train's front end, imported only when asked
    "manygpu.cli": 9,
    "manygpu.__main__": 9,
    "manygpu": 10,  # the package's lazy re-exports: for users, not for the library
}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


@functools.cache
def _tree(path: Path) -> ast.Module:
    """Parsed once per file for the whole module (read-only: the checks only walk it)."""
    return ast.parse(path.read_text(), filename=str(path))


@functools.cache
def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every manygpu import; ``from manygpu import x`` names ``x``."""
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("manygpu")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("manygpu"):
            base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (SRC.parent / sub.replace(".", "/")).exists() or (
                    SRC.parent / (sub.replace(".", "/") + ".py")
                ).exists()
                out.append((node.lineno, sub if is_module else base))
    return out


def test_no_upward_imports() -> None:
    wrong = []
    for path in FILES:
        here = _module(path)
        for line, target in _imports(path):
            if target == "manygpu" and path.name != "__init__.py":
                if _layer(here) < LAYERS["manygpu"]:
                    wrong.append(f"{here}:{line} imports the package root; import the module")
            elif _layer(target) > _layer(here):
                wrong.append(f"{here}:{line} imports {target} (a higher layer)")
    assert wrong == [], "\n".join(wrong)


def test_horovod_is_an_adapter_over_runtime_and_comm() -> None:
    """manygpu.horovod stands on runtime/ and comm/ (and errors); never on the strategies,
    the planner or Parallel, so either side can change without the other."""
    allowed = ("manygpu.horovod", "manygpu.runtime", "manygpu.comm", "manygpu.errors")
    wrong = [
        f"{_module(path)}:{line} imports {target}"
        for path in FILES
        if _module(path).startswith("manygpu.horovod")
        for line, target in _imports(path)
        if not target.startswith(allowed)
    ]
    assert wrong == [], "\n".join(wrong)


def test_environment_variables_are_read_only_in_runtime_env() -> None:
    wrong = []
    for path in FILES:
        if path == SRC / "runtime" / "env.py":
            continue
        tree = _tree(path)
        writes = {
            id(n.func.value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "update"  # handing variables to children is not reading
        }
        for node in ast.walk(tree):
            env = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            if env and id(node) not in writes:
                wrong.append(f"{_module(path)}:{node.lineno}")
    assert wrong == [], "read the environment through manygpu.runtime.env: " + ", ".join(wrong)


def _names_in(node: ast.AST, names: set[str]) -> list[str]:
    if isinstance(node, ast.Constant) and node.value in names:
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
    return []


def test_no_strategy_names_outside_strategies() -> None:
    """No branching on a strategy's name and no hand-kept name lists: ask the registry.

    "hybrid" is a rule, not a strategy, and is resolved in strategies/ as well
    ("auto" is also a precision, so it is not searched for)."""
    names = {*available(), "hybrid"}
    wrong = []
    for path in FILES:
        if (SRC / "strategies") in path.parents:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare):
                found = [n for c in [node.left, *node.comparators] for n in _names_in(c, names)]
            elif isinstance(node, ast.Tuple | ast.List | ast.Set):
                found = _names_in(node, names)
                found = found if len(found) >= 2 else []
            else:
                continue
            if found:
                wrong.append(f"{_module(path)}:{node.lineno} ({', '.join(found)})")
    assert wrong == [], "strategy names outside strategies/: " + "; ".join(wrong)


def _axes_named(node: ast.AST, names: set[str]) -> list[str]:
    """Axis names ``node`` branches on, indexes by, keys by or lists (a literal of
    axis names only: the strategy packages' list shares ``dp`` and ``fsdp``)."""
    if isinstance(node, ast.Compare):
        return [n for c in [node.left, *node.comparators] for n in _names_in(c, names)]
    if isinstance(node, ast.Subscript):
        return _names_in(node.slice, names) if isinstance(node.slice, ast.Constant) else []
    if isinstance(node, ast.Dict):
        return [n for k in node.keys if k is not None for n in _names_in(k, names)]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        found = _names_in(node, names)
        return found if len(found) >= 2 and len(found) == len(node.elts) else []
    return []


def test_mesh_axes_are_named_only_in_their_table() -> None:
    """The mesh's axes are data (strategies/axes.py): a new one is a table entry and a
    strategy package whose card names it. Elsewhere code asks the table (the data
    axes, the replica axis, the order) instead of naming an axis."""
    names = set(axis_names())
    own = [SRC / "strategies" / p for p in PACKAGES]
    wrong = []
    for path in FILES:
        if path == SRC / "strategies" / "axes.py" or any(p in path.parents for p in own):
            continue
        for node in ast.walk(_tree(path)):
            found = _axes_named(node, names)
            if found:
                wrong.append(f"{_module(path)}:{node.lineno} ({', '.join(found)})")
    assert wrong == [], "mesh axes named outside strategies/axes.py: " + "; ".join(wrong)


def test_every_registered_strategy_is_complete() -> None:
    """Adding a strategy means a card with every field, and a class behind it."""
    for name in available():
        entry = card(name)
        cls = get_strategy(name)
        assert issubclass(cls, Strategy) and cls.name == name and cls.card is entry
        assert entry.memory is not None and entry.comm is not None
        assert entry.checkpoint.name in ("full", "dcp")
        assert isinstance(entry.changes_loop, bool) and isinstance(entry.one_process, bool)
        assert cls.multi_process is not entry.one_process
        # The axes it composes are the table's, in the mesh's order.
        composed = entry.axes()
        assert composed == tuple(n for n in axis_names() if n in composed), entry.name
        assert entry.mesh_default in ("", *composed) and entry.hybrid_for in ("", *composed)
    simplicity = [card(n).simplicity for n in available()]
    assert len(set(simplicity)) == len(simplicity), "two strategies tie on simplicity"
    leads = [card(n).hybrid_for for n in available() if card(n).hybrid_for]
    assert len(set(leads)) == len(leads), "two strategies lead one axis for 'hybrid'"


def test_files_and_functions_stay_small() -> None:
    wrong = []
    for path in FILES:
        text = path.read_text()
        if text.count("\n") > 600:
            wrong.append(f"{_module(path)}: {text.count(chr(10))} lines (max 600)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = node.body[0]
                doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                start = (first.end_lineno or first.lineno) + 1 if doc else node.lineno
                length = (node.end_lineno or node.lineno) - start + 1
                if length > 60:
                    wrong.append(f"{_module(path)}.{node.name}: {length} lines (max 60)")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.slow  # a fresh interpreter each
@pytest.mark.parametrize(
    "code",
    [
        # Building a Parallel's class loads no DTensor (nor sympy): ~1 CPU-s of every
        # process that makes one; DTensor loads when a strategy shards a model.
        "import sys; from manygpu import *; Parallel, ParallelConfig, FSDP, Zero2, "
        "available_strategies; heavy = [m for m in ('torch.distributed.tensor', 'sympy', "
        "'torch._dynamo') if m in sys.modules]; assert not heavy, heavy",
        # Importing the package or building the CLI loads none of torch's heavy subsystems.
        "import sys, manygpu, manygpu.core, manygpu.launch, manygpu.checkpoint; "
        "heavy = [m for m in sys.modules if m.startswith('torch')]; assert not heavy, heavy",
    ],
)
def test_the_package_imports_cleanly(code: str) -> None:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_test_modules_have_unique_names() -> None:
    """Test directories are not packages, so pytest (and the rank server, which
    imports a rank's function by module name) knows a test module by its file
    name alone: two ``test_x.py`` in different directories break collection."""
    tests = SRC.parents[1] / "tests"
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each (e.g. add _ranks to the multi-rank one): {clashes}"


def test_parallel_is_a_facade_over_parts() -> None:
    """Parallel delegates (issue: a class of four mixin files whose stubs raised): it has
    no base class, stays about half the file cap, and no core module stubs a method
    with ``raise NotImplementedError`` for a sibling class to shadow."""
    from manygpu import Parallel

    assert Parallel.__bases__ == (object,), "compose a part instead of adding a base class"
    lines = (SRC / "core" / "parallel.py").read_text().count("\n")
    assert lines <= 400, f"core/parallel.py has {lines} lines: move the work into a part"
    stubs = [
        f"{_module(path)}:{node.lineno}"
        for path in FILES
        if _module(path).startswith(("manygpu.core", "manygpu.observe"))
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Raise)
        and "NotImplementedError" in ast.unparse(node.exc or ast.Constant(None))
    ]
    assert stubs == [], "a part gets what it needs in its constructor: " + ", ".join(stubs)


def test_per_step_work_hangs_on_the_one_step_event() -> None:
    """Everything at each optimizer step is a listener of core/steps.StepEvents: no other
    hook on an optimizer's step, no second step counter wrapped around a callback."""
    allowed = {SRC / "core" / "optimizer.py"}  # its passthrough of torch's hooks to users
    wrong = [
        f"{_module(path)}:{node.lineno}"
        for path in FILES
        if path not in allowed
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Attribute)
        and node.attr in ("register_step_post_hook", "register_step_pre_hook")
    ]
    assert wrong == [], "add a listener with par.events.on_step instead: " + ", ".join(wrong)


def test_the_checkpointer_asks_parallel_only_public_questions() -> None:
    """checkpoint/ saves and restores the job through ``par.job_state`` and reads only
    Parallel's public identity; a private attribute or a new Parallel method only the
    Checkpointer calls belongs on the job state."""
    allowed = {"job_state", "rank", "world_size", "is_main", "device", "timeout_s", "print",
               "close", "log", "profile", "seed_everything"}  # fmt: skip
    wrong = []
    for path in (SRC / "checkpoint").rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            is_par = (isinstance(owner, ast.Name) and owner.id == "par") or (
                isinstance(owner, ast.Attribute) and owner.attr == "par"
            )
            if is_par and node.attr not in allowed:
                wrong.append(f"{_module(path)}:{node.lineno} par.{node.attr}")
    assert wrong == [], "\n".join(wrong)


def test_strategies_hold_strategies_and_model_transforms_live_in_transforms() -> None:
    """strategies/ is the interface, the registry, shared machinery and one package per
    strategy; what changes a model without being a strategy lives in transforms/."""
    transforms = {p.stem for p in (SRC / "transforms").glob("*.py")} - {"__init__"}
    misplaced = sorted(p.name for p in (SRC / "strategies").glob("*.py") if p.stem in transforms)
    assert misplaced == [], f"move {misplaced} to manygpu/transforms/"
    assert {"blocks", "checkpointing", "running_stats", "channels_last", "fp8"} <= transforms


def _type_checking_names(path: Path) -> set[str]:
    """The names a package's ``if TYPE_CHECKING:`` block imports (its view for type checkers)."""
    names: set[str] = set()
    for node in _tree(path).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom):
                    names |= {a.asname or a.name for a in stmt.names}
    return names


@pytest.mark.parametrize("package", ["manygpu", "manygpu.strategies"])
def test_exports_derive_from_the_strategy_registry(package: str) -> None:
    """One list of strategies: the registry's ``OBJECTS``. The packages' lazy exports are
    built from it, and their ``TYPE_CHECKING`` imports (static, for type checkers) may
    name exactly what is exported, no more and no less."""
    import importlib

    from manygpu.strategies.registry import OBJECTS

    module = importlib.import_module(package)
    exported = set(module.__all__) - {"__version__"}
    assert set(OBJECTS) <= exported
    path = SRC / Path(*package.split(".")[1:]) / "__init__.py"
    static = _type_checking_names(path)
    assert static == exported, (
        f"{path.relative_to(SRC.parent)}: TYPE_CHECKING imports differ from the exports: "
        f"missing {sorted(exported - static)}, extra {sorted(static - exported)}; a strategy "
        "object is added by its line in strategies/registry.py's OBJECTS"
    )
    for name in OBJECTS:
        assert getattr(module, name).__name__ == name


# One home per concept: each named function (or class) is defined in its module only;
# a second definition anywhere else is a second format, a second set of error texts.
ONE_HOME: list[tuple[str, str, re.Pattern[str]]] = [
    ("the --nnodes N|MIN:MAX reader", "manygpu.launch.spec", re.compile(r"nnodes", re.I)),
    (
        "the rank-list formatter",
        "manygpu.runtime.ranks",
        re.compile(r"ranks?_?(text|list|ranges?|span)|^_?ranges$", re.I),
    ),
    ("the job's secret", "manygpu.runtime.secret", re.compile(r"^_?\w*Secret$")),
]


@pytest.mark.parametrize(("what", "home", "name"), ONE_HOME, ids=[w for w, _, _ in ONE_HOME])
def test_one_home_per_concept(what: str, home: str, name: re.Pattern[str]) -> None:
    defs = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    wrong = [
        f"{_module(path)}:{node.lineno} defines {node.name}"
        for path in FILES
        if _module(path) != home
        for node in ast.walk(_tree(path))
        if isinstance(node, defs) and name.search(node.name)
    ]
    assert wrong == [], f"{what} lives in {home}; import it from there: " + "; ".join(wrong)


def test_one_secret_module() -> None:
    """The job's secret (loading, keys, when a job needs one) is one module."""
    named = [_module(p) for p in FILES if "secret" in p.stem]
    assert named == ["manygpu.runtime.secret"], f"fold these into runtime/secret.py: {named}"


SHARED_CLASS_NAMES: set[str] = set()
"""Two classes by one name today (rename one, then drop it here; never add)."""


def test_no_two_classes_share_a_name() -> None:
    """One name, one thing: two unrelated ``JobOptions`` read alike in a traceback."""
    seen: dict[str, list[str]] = {}
    for path in FILES:
        for node in _tree(path).body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(_module(path))
    shared = {name: mods for name, mods in seen.items() if len(mods) > 1}
    assert set(shared) <= SHARED_CLASS_NAMES, f"rename one of each: {shared}"
    assert set(shared) == SHARED_CLASS_NAMES, "a shared name is gone: drop it from the list"
