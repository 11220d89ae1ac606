"""A launched tool's configuration: built once by its command, handed to every worker.

``manygpu bench comm``, ``bench train``, ``doctor`` and ``demo`` parse their
options once, build a frozen configuration dataclass (validated on
construction) and launch their workers with it as JSON in one environment
variable (:data:`~manygpu.runtime.env.TOOL_CONFIG`). Each worker rebuilds the
same dataclass, validated again, instead of parsing a command line of its own,
so the command and its workers cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, TypeVar

from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime.env import Environ

T = TypeVar("T")


def worker_env(config: Any) -> dict[str, str]:
    """The variables that hand ``config`` (a dataclass instance) to launched workers."""
    payload = {"type": type(config).__qualname__, "config": dataclasses.asdict(config)}
    return {envmod.TOOL_CONFIG: json.dumps(payload)}


def received(cls: type[T], env: Environ | None = None) -> T:
    """The ``cls`` configuration this worker's command handed over.

    The type is checked by its name only: a worker runs its module as
    ``__main__``, where the class is a second copy of the command's.
    """
    text = envmod.tool_config(envmod.current() if env is None else env)
    if text is None:
        raise UsageError(
            f"no {cls.__qualname__} in {envmod.TOOL_CONFIG}: this program is started by "
            "its manygpu command (bench comm, bench train, doctor or demo), not directly"
        )
    payload = json.loads(text)
    if payload.get("type") != cls.__qualname__:
        raise UsageError(
            f"{envmod.TOOL_CONFIG} holds a {payload.get('type')}, not a {cls.__qualname__}"
        )
    return decode(cls, payload["config"])


def decode(cls: type[T], data: dict[str, Any]) -> T:
    """``cls`` from its ``dataclasses.asdict`` form after a JSON round trip.

    Nested dataclasses are rebuilt from their dicts and JSON's lists become
    tuples again (configurations are frozen); ``cls`` validates the result.
    """
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        value, hint = data[f.name], hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = decode(hint, value)
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return cls(**values)
