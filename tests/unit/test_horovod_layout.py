"""manygpu.horovod's shape, guarded: one call path, one owner per piece of state.

The package's docstring writes the path a call goes down (scope -> agree ->
match -> join -> start) and who owns what. These tests keep it true: a step
imports only the steps after it (and the foundations beneath the path), no
module imports another inside a function (how the old knot hid its cycles),
and each piece of state is reached only from the module that owns it. A failure
says which module and line, and what to do instead.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import manygpu.horovod as hvd
from manygpu.horovod import basics, pending

PACKAGE = Path(hvd.__file__).resolve().parent
MODULES = {p.stem: p for p in sorted(PACKAGE.glob("*.py"))}

PATH = ("process_sets", "checks", "matching", "joining", "pending")
"""The call path's modules, in order: scope -> agree -> match -> join -> start."""
FOUNDATIONS = ("basics", "reports", "exceptions", "wire", "missing", "compression", "buckets")
"""Beneath the path: every step may read them; they import only each other."""
CALLS = (
    "__init__",
    "lifecycle",
    "handles",
    "stand_in",
    "reduce_ops",
    "data_ops",
    "grouped",
    "sparse",
    "functions",
    "differentiable",
    "grad_sync",
    "optimizer",
    "optimizer_state",
)
"""Above the path: the API's calls, which may use any step."""
OWNERS = {
    "basics": "Session",
    "reports": "_Calls",
    "process_sets": "SetTable",
    "matching": "_Names",
    "joining": "_Joins",
    "pending": "_Handles",
}
"""Each piece of the session's state, by the module that owns it, and its class."""


def _tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))


def _horovod_imports(node: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for each manygpu.horovod module ``node`` imports."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.ImportFrom) and n.module == "manygpu.horovod":
            out += [(n.lineno, a.name) for a in n.names if a.name in MODULES]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("manygpu.horovod."):
            out.append((n.lineno, (n.module or "").split(".")[2]))
        elif isinstance(n, ast.Import):
            out += [
                (n.lineno, a.name.split(".")[2])
                for a in n.names
                if a.name.startswith("manygpu.horovod.")
            ]
    return out


def test_every_module_has_a_place() -> None:
    """A new module says where it stands: on the path, beneath it, or above it."""
    placed = set(PATH) | set(FOUNDATIONS) | set(CALLS)
    assert set(MODULES) - placed == set(), (
        "add each new manygpu.horovod module to PATH, FOUNDATIONS or CALLS here "
        "(and to the package's docstring when it is a step)"
    )
    assert set(OWNERS) <= set(PATH) | set(FOUNDATIONS)


def test_the_call_path_goes_one_way() -> None:
    """A step imports only later steps and the foundations; foundations only each other."""
    wrong = []
    for name in MODULES:
        if name in PATH:
            allowed = set(FOUNDATIONS) | set(PATH[PATH.index(name) + 1 :])
        elif name in FOUNDATIONS:
            allowed = set(FOUNDATIONS)
        else:
            continue
        for line, target in _horovod_imports(_tree(name)):
            if target != name and target not in allowed:
                wrong.append(f"horovod/{name}.py:{line} imports {target}, earlier on the path")
    assert wrong == [], (
        "\n".join(wrong) + "\nmove what both need beneath the path (basics, reports), "
        "or hand the later step a function to call, as matching.launch takes its start"
    )


def test_no_imports_inside_functions() -> None:
    """Imports at a function's top hid the cycles of the old knot: every import is at
    module level, where the test above sees it."""
    wrong = []
    for name in MODULES:
        for fn in ast.walk(_tree(name)):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                wrong += [
                    f"horovod/{name}.py:{line} imports {t}" for line, t in _horovod_imports(fn)
                ]
    assert wrong == [], "\n".join(wrong)


def test_the_path_is_written_in_the_package_docstring() -> None:
    doc = hvd.__doc__ or ""
    assert "scope -> agree -> match -> join -> start" in doc
    places = [doc.find(f":mod:`~manygpu.horovod.{name}`") for name in PATH]
    assert -1 not in places and places == sorted(places), (
        f"the package's docstring names the path's modules in order: {PATH}"
    )


def _classes(name: str) -> set[str]:
    return {n.name for n in ast.walk(_tree(name)) if isinstance(n, ast.ClassDef)}


def test_each_piece_of_state_has_one_owner() -> None:
    """An owner's state class is named only in its module; ``owned(X)`` is asked only by
    the module that defines ``X``; nobody assigns into another module's names."""
    wrong = []
    for owner, cls in OWNERS.items():
        assert cls in _classes(owner), f"{cls} is no longer defined in horovod/{owner}.py"
    for name in MODULES:
        tree = _tree(name)
        for owner, cls in OWNERS.items():
            if owner == name or (owner, cls) == ("basics", "Session"):
                continue
            for n in ast.walk(tree):
                if (isinstance(n, ast.Name) and n.id == cls) or (
                    isinstance(n, ast.Attribute) and n.attr == cls
                ):
                    wrong.append(f"horovod/{name}.py:{n.lineno} reaches {owner}'s {cls}")
        mine = _classes(name)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "owned":
                arg = n.args[0] if n.args else None
                if not (isinstance(arg, ast.Name) and arg.id in mine):
                    wrong.append(f"horovod/{name}.py:{n.lineno} asks owned() for another's state")
        wrong += _foreign_assignments(name, tree)
    assert wrong == [], (
        "\n".join(wrong) + "\nask the owner's module to change its state (a function there)"
    )


def _foreign_assignments(name: str, tree: ast.Module) -> list[str]:
    """Assignments to an attribute of something imported from another horovod module."""
    imported = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("manygpu.horovod"):
            imported |= {a.asname or a.name for a in n.names}
    out = []
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else []
        if isinstance(n, ast.AugAssign | ast.AnnAssign):
            targets = [n.target]
        for target in targets:
            root = target
            while isinstance(root, ast.Attribute | ast.Subscript):
                root = root.value
            if root is not target and isinstance(root, ast.Name) and root.id in imported:
                out.append(f"horovod/{name}.py:{target.lineno} assigns into {root.id}")
    return out


def test_the_session_holds_only_what_is_global() -> None:
    """The session is frozen and keeps the job, its group and its timeout; each step's
    state is its owner's, in ``owned`` (a new field here is a new shared knot)."""
    assert dataclasses.is_dataclass(basics.Session)
    assert basics.Session.__dataclass_params__.frozen  # type: ignore[attr-defined]
    fields = [f.name for f in dataclasses.fields(basics.Session)]
    assert fields == ["topology", "ctx", "timeout_s", "owned"]


def test_pending_records_change_only_in_their_module() -> None:
    """Records are frozen: pending.begin replaces one when its call starts."""
    assert pending.Pending.__dataclass_params__.frozen  # type: ignore[attr-defined]
