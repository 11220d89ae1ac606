"""The launcher says, once, the thread count it chose for the workers (as torchrun does).

A count the user chose reaches the workers unsaid: checked on the torchrun script's job
in tests/launch/test_launch.py (OMP_NUM_THREADS=2 there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_launch import manygpu

from manygpu.runtime.device import cpu_count


def test_the_chosen_thread_count_is_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "threads.py"
    script.write_text("import os\nprint('threads', os.environ['OMP_NUM_THREADS'])\n")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    res = manygpu("launch", "--nproc-per-node", "2", str(script))
    assert res.returncode == 0, res.stderr
    said = [ln for ln in res.stderr.splitlines() if "OMP_NUM_THREADS" in ln]
    threads = {ln.split()[-1] for ln in res.stdout.splitlines() if "threads" in ln}
    (n,) = threads
    assert said == [
        f"manygpu: OMP_NUM_THREADS={n} for each of the 2 workers on this node "
        f"({cpu_count()} CPUs split among them); "
        "set OMP_NUM_THREADS to choose"
    ], res.stderr
