"""launch/settle.py: after a configuration error, the agent lets the other workers end.

The workers here are real processes (``sh``), each with a torch-format error file.
Through a real launch: tests/launch/test_first_hour.py (one line for both ranks).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from manygpu.launch.settle import is_configuration_error, settle_configuration_error


@dataclass
class Handler:
    proc: subprocess.Popen[bytes]


@dataclass
class Context:
    subprocess_handlers: dict[int, Handler]
    error_files: dict[int, str]


def _error_file(path: Path, message: str) -> str:
    record = {"message": {"message": message, "extraInfo": {"timestamp": "0"}}}
    path.write_text(json.dumps(record))
    return str(path)


def _context(tmp_path: Path, first_error: str, second_s: float) -> Context:
    failed = subprocess.Popen(["sh", "-c", "exit 1"])
    failed.wait()
    later = subprocess.Popen(["sleep", str(second_s)])
    files = {0: _error_file(tmp_path / "e0.json", first_error), 1: str(tmp_path / "none.json")}
    return Context({0: Handler(failed), 1: Handler(later)}, files)


def test_after_a_configuration_error_the_others_are_waited_for(tmp_path: Path) -> None:
    ctx = _context(tmp_path, "UsageError: unknown strategy 'fdsp'", 0.5)
    start = time.monotonic()
    settle_configuration_error(ctx, settle_s=10)
    assert ctx.subprocess_handlers[1].proc.poll() == 0  # it ended on its own
    assert time.monotonic() - start < 5


def test_any_other_failure_is_not_waited_for(tmp_path: Path) -> None:
    ctx = _context(tmp_path, "ValueError: boom", 30)
    try:
        start = time.monotonic()
        settle_configuration_error(ctx, settle_s=10)
        assert time.monotonic() - start < 1
        assert ctx.subprocess_handlers[1].proc.poll() is None
    finally:
        ctx.subprocess_handlers[1].proc.kill()
        ctx.subprocess_handlers[1].proc.wait()


def test_the_wait_has_an_end(tmp_path: Path) -> None:
    ctx = _context(tmp_path, "UsageError: unknown strategy 'fdsp'", 30)
    try:
        start = time.monotonic()
        settle_configuration_error(ctx, settle_s=0.3)
        assert 0.25 < time.monotonic() - start < 3
    finally:
        ctx.subprocess_handlers[1].proc.kill()
        ctx.subprocess_handlers[1].proc.wait()


@pytest.mark.parametrize(
    "text, usage",
    [
        (json.dumps({"message": {"message": "UsageError: x"}}), True),
        (json.dumps({"message": "UsageError: x"}), True),
        (json.dumps({"message": {"message": "RuntimeError: UsageError: x"}}), False),
        ("not json", False),
        (json.dumps([1]), False),
    ],
)
def test_a_configuration_error_is_read_from_torch_s_error_file(
    tmp_path: Path, text: str, usage: bool
) -> None:
    path = tmp_path / "error.json"
    path.write_text(text)
    assert is_configuration_error(str(path)) is usage
    assert not is_configuration_error(str(tmp_path / "missing.json"))
    assert not is_configuration_error(None)
