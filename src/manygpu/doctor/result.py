"""The verdict of a check, and small helpers every check module shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail"]
SEVERITY: dict[str, int] = {"ok": 0, "warn": 1, "fail": 2}


@dataclass
class CheckResult:
    """The verdict of one check."""

    name: str
    status: Status
    message: str
    fix: str = ""
    host: str = ""
    """Which node it is about, when the report covers several."""


def ok(name: str, message: str) -> CheckResult:
    return CheckResult(name, "ok", message)


def warn(name: str, message: str, fix: str) -> CheckResult:
    return CheckResult(name, "warn", message, fix)


def fail(name: str, message: str, fix: str) -> CheckResult:
    return CheckResult(name, "fail", message, fix)


def worst(results: Sequence[CheckResult]) -> Status:
    """The most severe status among ``results`` (``ok`` when empty)."""
    return max((r.status for r in results), key=SEVERITY.__getitem__, default="ok")


def human_bytes(n: float) -> str:
    """``67108864`` -> ``64 MB`` (powers of 1024, as ``df -h``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if n == int(n) or abs(n) >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
