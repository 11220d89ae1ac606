"""``hvd.init()`` after ``hvd.shutdown()`` under ``manygpu launch``, fifty times.

Under the launcher the ranks meet on the agent's store (not one rank 0 hosts,
as in tests/distributed/test_horovod_lifecycle.py): every default group used
to take the same keys there, so a new group could read the last one's gloo
addresses and hang, then fail with "connect timeout" or "connection reset".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jobs import subprocess_env

SCRIPT = Path(__file__).parent / "scripts" / "hvd_rounds.py"
ROUNDS = 50


def test_fifty_rounds_under_manygpu_launch() -> None:
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", "2", str(SCRIPT),
         str(ROUNDS)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    want = [f"round {i} sum {1 + 2 * i}" for i in range(ROUNDS)]
    assert res.stdout.splitlines() == want
