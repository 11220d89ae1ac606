"""Hang verdicts on 2 emulated hosts x 2 ranks: the last rank (rank 3, on host 1)
stops the job from moving in each way a user meets; the verdict, printed by the
host that serves the store, names that rank, its host and its line (or says it is
stopped / in native code) within the timeout plus a few seconds, and no process
of the job is left on either host.

Static rendezvous with --timeout 12: the alarm goes off after 6 s of waiting.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from jobs import subprocess_env

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "scripts" / "hang_kinds.py"
TIMEOUT = 12
HOST1 = r"rank 3 \(host 10\.\d+\.\d+\.2\)"
EXPECTED = {
    "spin": HOST1 + r" never entered all_reduce #2 that ranks 0-2 wait in; rank 3 is at "
    r"hang_kinds\.py:32 in save_checkpoint\(\)",
    "loader": HOST1 + r" never entered all_reduce #4 that ranks 0-2 wait in; rank 3 is at "
    r"hang_kinds\.py:62, in the DataLoader \(worker \d at hang_kinds\.py:41 in __getitem__\(\)\)",
    "stop": HOST1 + r" never entered all_reduce #2 that ranks 0-2 wait in; "
    r"rank 3 is stopped \(SIGSTOP or a debugger\)",
    "native": HOST1 + r" never entered all_reduce #2 that ranks 0-2 wait in; rank 3 does not "
    r"answer: it is in native code holding the GIL at hang_kinds\.py:70",
    "ddp_skip": r"all ranks wait in collective #10; rank 3 \(host 10\.\d+\.\d+\.2\) started it "
    r"as barrier\(\), the others as all_reduce\(float32\[10\]\); rank 3 at hang_kinds\.py:59",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as hosts:
        yield hosts


def _job(cluster: EmulatedCluster, kind: str, out: Path, port: int) -> tuple[list, float]:
    argv = [
        [
            sys.executable, "-m", "manygpu", "launch", "--nnodes", "2", "--node-rank", str(i),
            "--nproc-per-node", "2", "--master-addr", cluster.addresses[0],
            "--master-port", str(port), "--timeout", str(TIMEOUT), "--term-timeout", "3",
            str(SCRIPT), kind, str(out),
        ]
        for i in range(2)
    ]  # fmt: skip
    start = time.monotonic()
    results = cluster.run_all(argv, timeout=150, env=subprocess_env(namespace=True))
    return results, time.monotonic() - start


def _left(out: Path) -> list[int]:
    deadline = time.monotonic() + 10
    pids = [int(p.read_text()) for p in out.glob("pid*")]
    assert len(pids) == 4, pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_the_verdict_names_the_rank_its_host_and_its_line(
    cluster: EmulatedCluster, tmp_path: Path, kind: str
) -> None:
    port = 29560 + list(EXPECTED).index(kind)
    results, elapsed = _job(cluster, kind, tmp_path, port)
    serving = results[0].stderr
    lines = [line for line in serving.splitlines() if line.startswith("manygpu: hang: ")]
    assert len(lines) == 1, serving[-3000:]
    assert re.fullmatch("manygpu: hang: " + EXPECTED[kind], lines[0]), lines[0]
    assert [r.returncode for r in results] == [124, 124], [r.stderr[-1500:] for r in results]
    assert "manygpu: evidence (stacks and collective records per rank): " in serving
    # Start-up of 4 ranks on 2 loaded cores, the timeout, and the stop.
    assert elapsed < TIMEOUT + 35, f"took {elapsed:.1f}s"
    assert _left(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_rank_that_aborts_on_a_shape_mismatch_is_named_with_its_line(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    """gloo aborts the process on a size mismatch: not a hang but a crash; the first
    failure is named, with the line faulthandler saw it at."""
    results, _ = _job(cluster, "shape", tmp_path, 29569)
    report = [line for line in results[1].stderr.splitlines() if line.startswith("manygpu: ")]
    assert report[0].startswith("manygpu: rank 3 was killed by SIGABRT"), report
    assert report[0].endswith(" at hang_kinds.py:73"), report
    assert _left(tmp_path) == []
