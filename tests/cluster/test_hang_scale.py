"""A hang verdict at scale: 16 emulated hosts x 4 ranks (64 mostly waiting workers).

Rank 63 (the last host's last rank) spins in ``save_checkpoint()`` and never
reaches the next all_reduce; the 63 others wait in it. Each host's launcher
gathers its own four workers and sends the store's host one message; the store's
host reads sixteen, not sixty-four, and prints the verdict. It must name rank 63,
its host and its line within the timeout plus 15 s of the wait beginning, and
leave no process behind.

Opt-in (``scale`` mark, ``MANYGPU_SCALE_TESTS=1``): 80 Python processes that
import torch take ~12 GB and minutes of this 2-core machine's time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from jobs import subprocess_env

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "scripts" / "hang_kinds.py"
HOSTS, RANKS, TIMEOUT = 16, 4, 60


@pytest.mark.slow
@pytest.mark.scale
@pytest.mark.timeout(900)
def test_a_verdict_over_16_hosts_x_4_ranks_names_the_rank(tmp_path: Path) -> None:
    with EmulatedCluster(HOSTS, LinkShape(rate="1gbit")) as cluster:
        procs = [
            cluster.popen(
                i,
                [
                    sys.executable, "-m", "manygpu", "launch", "--nnodes", str(HOSTS),
                    "--node-rank", str(i), "--nproc-per-node", str(RANKS),
                    "--master-addr", cluster.addresses[0], "--master-port", "29680",
                    "--timeout", str(TIMEOUT), "--term-timeout", "3", str(SCRIPT), "spin",
                    str(tmp_path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=subprocess_env(namespace=True),
                start_new_session=True,
            )
            for i in range(HOSTS)
        ]  # fmt: skip
        errs, codes = [], []
        try:
            for proc in procs:
                errs.append(proc.communicate(timeout=800)[1])
                codes.append(proc.returncode)
        finally:
            for proc in procs:
                proc.kill()
    serving = errs[0]
    lines = [ln for ln in serving.splitlines() if ln.startswith("manygpu: hang: ")]
    assert lines == [
        "manygpu: hang: rank 63 (host 10.213.0.16) never entered all_reduce #2 that ranks "
        "0-62 wait in; rank 63 is at hang_kinds.py:32 in save_checkpoint()"
    ], serving[-3000:]
    assert codes == [124] * HOSTS, [e[-800:] for e in errs if e]
    where = Path(
        next(ln for ln in serving.splitlines() if ln.startswith("manygpu: evidence (")).rsplit(
            ": ", 1
        )[1]
    )
    record = json.loads((where / "verdict.json").read_text())
    assert len(record["ranks"]) == HOSTS * RANKS
    assert len({r["host"] for r in record["ranks"]}) == HOSTS  # one message per host
    began = [
        json.loads(p.read_text())["waiting"]["since"] for p in where.glob("progress-rank*.json")
    ]
    took = (where / "verdict.json").stat().st_mtime - min(began)
    assert took < TIMEOUT + 15, f"the verdict came {took:.1f}s after the wait began"
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == HOSTS * RANKS
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == []
