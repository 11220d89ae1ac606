"""Tracker names, the optional extra each needs, and opening one by name (imported only then)."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from manygpu.errors import UsageError
from manygpu.tracking.base import RunInfo, Tracker


@dataclass(frozen=True)
class Entry:
    """Where a tracker lives and what it needs installed."""

    module: str
    """The module whose ``open_run(info)`` opens it."""
    needs: str | None
    """The library it imports (``None``: nothing beyond manygpu)."""
    extra: str | None
    """The ``pip install 'manygpu[extra]'`` that brings that library."""


TRACKERS: dict[str, Entry] = {
    "tensorboard": Entry("manygpu.tracking.tensorboard", "tensorboard", "tensorboard"),
    "mlflow": Entry("manygpu.tracking.mlflow", "mlflow", "mlflow"),
    "wandb": Entry("manygpu.tracking.wandb", "wandb", "wandb"),
    "jsonl": Entry("manygpu.tracking.jsonl", None, None),
}


def check_names(names: str | Sequence[str] | None) -> tuple[str, ...]:
    """``log_with`` as a tuple of known names, each once; a bad one is one UsageError line."""
    if names is None:
        return ()
    given = [names] if isinstance(names, str) else list(names)
    known = ", ".join(TRACKERS)
    for name in given:
        if not isinstance(name, str):
            raise UsageError(f"log_with takes tracker names ({known}), not {name!r}")
        if name not in TRACKERS:
            close = difflib.get_close_matches(name.lower(), list(TRACKERS), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"unknown tracker {name!r} in log_with{hint} (known: {known})")
    return tuple(dict.fromkeys(given))


def check_installed(name: str) -> None:
    """Fail in one line when the library tracker ``name`` needs is missing."""
    entry = TRACKERS[name]
    if entry.needs is None:
        return
    try:
        importlib.import_module(entry.needs)
    except ImportError:
        raise UsageError(
            f"log_with={name!r} needs {entry.needs}, which is not installed: "
            f"pip install 'manygpu[{entry.extra}]'"
        ) from None


def check_store(name: str, run_dir: Path) -> None:
    """Open tracker ``name``'s store now, when its module can (``check_store(run_dir)``):
    a refused store is one line when ``Parallel`` is built, not at the first log."""
    module = importlib.import_module(TRACKERS[name].module)
    check = getattr(module, "check_store", None)
    if check is not None:
        check(run_dir)


def open_tracker(name: str, info: RunInfo) -> Tracker:
    """Open tracker ``name`` on ``info``'s run (imports its library now)."""
    check_installed(name)
    module = importlib.import_module(TRACKERS[name].module)
    tracker: Tracker = module.open_run(info)
    return tracker
