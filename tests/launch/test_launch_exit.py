"""A launcher exits with its job's exit code whatever its hang watch is doing at the end.

The watch (a daemon thread) calls the job's store. One that came back from a
store call while the interpreter finalized aborted the launcher after a good
job (SIGABRT, "terminate called without an active exception"); see
scripts/watch_in_store_call.py, which puts the watch in a store call as the job
ends, every time.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from jobs import subprocess_env

SCRIPT = Path(__file__).parent / "scripts" / "watch_in_store_call.py"


@pytest.mark.parametrize(("job", "code"), [("print('done')", 0), ("raise SystemExit(3)", 3)])
def test_the_launcher_waits_for_its_watch_to_leave_the_store(
    tmp_path: Path, job: str, code: int
) -> None:
    script = tmp_path / "job.py"
    script.write_text(job + "\n")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "launch", "--nproc-per-node", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=subprocess_env(),
    )
    assert "the hang watch is in a store call" in res.stderr, res.stderr[-3000:]
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == code, res.stderr[-3000:]
