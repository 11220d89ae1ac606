"""Strategy names -> classes, so no code outside ``strategies/`` branches on a name."""

from __future__ import annotations

from collections.abc import Callable

from manygpu.errors import UsageError
from manygpu.strategies.base import Strategy

_REGISTRY: dict[str, type[Strategy]] = {}


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator: make a strategy available under ``name``."""

    def wrap(cls: type[Strategy]) -> type[Strategy]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"strategy {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    """Registered strategy names, sorted."""
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type[Strategy]:
    """The class registered as ``name``; a clear error for unknown names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(
            f"unknown strategy {name!r}; choose one of: {', '.join(available())}"
        ) from None
