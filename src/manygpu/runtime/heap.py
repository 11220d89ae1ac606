"""Freeze torch's objects out of the garbage collector once ``import torch`` returns.

Importing torch leaves ~175,000 objects tracked by Python's cyclic collector.
Every full collection walks them again, though they live as long as the
process: the collections during the import itself, the occasional full one
while training, and the ones the interpreter runs at exit. A forked DataLoader
worker also copies every page whose objects a collection touches. Measured on
2 cores (2026-11-28): ``python -c "import torch"`` spends ~0.6 s of CPU more
than the same with ``os._exit`` at the end; with this module, a 2-worker
``manygpu launch`` of a script that imports torch costs 4.5 CPU-s instead of 5.8
(launcher and workers together; BENCHMARKS.md).

:func:`freeze_after_torch_import` makes the coming ``import torch`` run with
the collector paused, then collects once and moves what exists at that moment
to the permanent generation (:func:`gc.freeze`, CPython's tool for exactly
this). Objects the program creates afterwards are collected as usual, so a
file left open in a reference cycle is still flushed at exit. Objects made
before torch's import (what a script does above ``import torch``) are frozen
with it: they are never freed by the collector, as if still referenced.
``MANYGPU_GC_FREEZE=0`` turns it off (``bench/launch_overhead.py`` compares).
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

from manygpu.runtime import env as envmod

WATCHED = {"torch": True, "torch._dynamo": False}
"""Imports run with the collector paused, and whether the heap is frozen after each.

``torch._dynamo`` (~120,000 more objects) loads when the script builds its first
optimizer (torch's ``Optimizer.__init__`` imports it): by then the heap holds the
script's model and tensors, which must stay collectable, so that import is only
paused (~0.2 CPU-s less), not followed by a freeze."""


class _TorchWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders give for a watched module."""

    def __init__(self) -> None:
        self._pending = dict(WATCHED)

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        freeze = self._pending.pop(fullname, None)
        if freeze is None:
            return None
        if not self._pending:
            _unwatch()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Paused(spec.loader, freeze)
                return spec
        return None


class _Paused(importlib.abc.Loader):
    """Runs the module's own loader with the collector paused, then freezes the heap if asked."""

    def __init__(self, inner: Any, freeze: bool) -> None:
        self._inner, self._freeze = inner, freeze

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Put the module's own loader back first: importlib.resources and friends ask it.
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._inner.exec_module(module)
        finally:
            if was_enabled:
                gc.enable()
        if self._freeze:
            gc.collect()  # the import's own garbage, not kept forever
            gc.freeze()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _unwatch() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchWatch)]


def freeze_after_torch_import() -> None:
    """Freeze the heap when ``import torch`` next completes (nothing if torch is loaded)."""
    if not envmod.gc_freeze_wanted(envmod.current()):
        return
    if "torch" in sys.modules or any(isinstance(f, _TorchWatch) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchWatch())
