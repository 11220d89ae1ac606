"""An uncaught configuration error in a plain ``python train.py`` is one line."""

from __future__ import annotations

import sys

import pytest

import manygpu
from manygpu import UsageError, _excepthook


def _die_of(exc: BaseException) -> None:
    _excepthook._hook(type(exc), exc, exc.__traceback__)


def test_install_puts_the_hook_over_the_one_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import manygpu`` calls install (a plain ``python`` run shows it end to end:
    tests/launch/test_first_hour.py); test runners replace the hook, so check install."""
    assert manygpu is not None
    before = sys.excepthook
    monkeypatch.setattr(sys, "excepthook", before)  # restored after the test
    monkeypatch.setattr(_excepthook, "_previous", _excepthook._previous)
    _excepthook.install()
    assert sys.excepthook is _excepthook._hook
    assert _excepthook._previous is before or before is _excepthook._hook


def test_a_usage_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    _die_of(UsageError("unknown strategy 'fdsp'; did you mean 'fsdp'?"))
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "manygpu: unknown strategy 'fdsp'; did you mean 'fsdp'? (MANYGPU_TRACEBACK=1 shows where)"
    ]


def test_other_errors_and_a_requested_traceback_go_to_the_previous_hook(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[type[BaseException]] = []
    monkeypatch.setattr(_excepthook, "_previous", lambda kind, exc, tb: seen.append(kind))
    _die_of(ValueError("a user's own bug"))
    monkeypatch.setenv("MANYGPU_TRACEBACK", "1")
    _die_of(UsageError("wrong"))
    assert seen == [ValueError, UsageError]
    assert capsys.readouterr().err == ""
