"""runtime/heap.py in this process, where torch is already loaded.

What it does to a fresh worker (torch's objects frozen as torch loads, a file
left in a reference cycle still flushed at exit) is checked through a real
launch: tests/launch/test_launch.py::test_a_finished_job_exits_as_plain_python_would.
"""

from __future__ import annotations

import sys

from manygpu.runtime.heap import freeze_after_torch_import


def test_nothing_is_watched_once_torch_is_loaded() -> None:
    assert "torch" in sys.modules
    finders = list(sys.meta_path)
    freeze_after_torch_import()
    assert sys.meta_path == finders
