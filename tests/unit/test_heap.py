"""runtime/heap.py in this process, where torch is already loaded.

What it does to a fresh worker (torch's objects frozen as torch loads, a file
left in a reference cycle still flushed at exit) is checked through a real
launch: tests/launch/test_launch.py::test_a_finished_job_exits_as_plain_python_would.
"""

from __future__ import annotations

import sys

import pytest

from manygpu.runtime.env import gc_freeze_wanted
from manygpu.runtime.heap import freeze_after_torch_import


def test_nothing_is_watched_once_torch_is_loaded() -> None:
    assert "torch" in sys.modules
    finders = list(sys.meta_path)
    freeze_after_torch_import()
    assert sys.meta_path == finders


def test_the_freeze_is_on_unless_turned_off() -> None:
    assert gc_freeze_wanted({})
    assert gc_freeze_wanted({"MANYGPU_GC_FREEZE": "1"})
    for off in ("0", "false", "OFF", "no"):
        assert not gc_freeze_wanted({"MANYGPU_GC_FREEZE": off})


def test_turned_off_nothing_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where torch is not loaded yet (here it is hidden from ``sys.modules``)."""
    monkeypatch.setenv("MANYGPU_GC_FREEZE", "0")
    monkeypatch.delitem(sys.modules, "torch")
    finders = list(sys.meta_path)
    freeze_after_torch_import()
    assert sys.meta_path == finders
