"""Lazy re-exports for package ``__init__`` files (PEP 562).

A package that re-exports names from its modules would import them all, and
with them torch's heavy subsystems, on the first ``import manygpu``. Instead
each name is imported on first use; a ``TYPE_CHECKING`` block in the package
keeps the names visible to type checkers and IDEs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from manygpu.errors import UsageError


def exports(
    package: str, where: Mapping[str, str], removed: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``name -> module`` it lives in.

    ``removed``: names the package no longer has, each with what to use instead; a
    script importing one gets that one line (a :class:`UsageError`, which ``from ...
    import`` does not turn into a bare "cannot import name") instead of a traceback."""

    def getattr_(name: str) -> Any:
        if removed and name in removed:
            raise UsageError(f"{package}.{name} was removed: {removed[name]}")
        try:
            module = where[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        setattr(importlib.import_module(package), name, value)  # next time: no lookup
        return value

    def dir_() -> list[str]:
        return sorted(where)

    return getattr_, dir_
