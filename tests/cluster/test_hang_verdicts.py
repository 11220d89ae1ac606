"""Hang verdicts on 2 emulated hosts: the last rank (on host 1) stops the job from
moving in each way a user meets; the verdict, printed by the host that serves the
store, names that rank, its host and its line (or says it is stopped / in native
code) within the timeout plus a few seconds, and no process of the job is left on
either host. One rank per host (rank 1 the culprit), but for the DDP job whose
culprit calls another collective than the rest: that verdict names the odd one out
of a majority, so it runs 2 ranks per host (rank 3 the culprit). Python that spins
(``save_checkpoint()`` never returns) is not run here: test_launch_hosts.py's hang
over ssh is that job on 2 hosts, its verdict checked word for word, with exit 124 and
nothing left on either host (a second job of it here cost ~9 s of CPU).

Static rendezvous with --timeout 20: the alarm goes off after 10 s of waiting. The
five jobs run at once (each mostly waits), which keeps the suite short; the
verdict's delay is measured from when the waiting ranks' watchers saw the wait.
"""

from __future__ import annotations

import json
import re
import subprocess
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
TIMEOUT = 20
HOST1 = r"rank 1 \(host 10\.\d+\.\d+\.2\)"
EXPECTED = {
    "loader": HOST1 + r" never entered all_reduce #4 that rank 0 waits in; rank 1 is at "
    r"hang_kinds\.py:62, in the DataLoader \(worker \d at hang_kinds\.py:41 in __getitem__\(\)\)",
    "stop": HOST1 + r" never entered all_reduce #2 that rank 0 waits in; "
    r"rank 1 is stopped \(SIGSTOP or a debugger\)",
    "native": HOST1 + r" never entered all_reduce #2 that rank 0 waits in; rank 1 does not "
    r"answer: it is in native code holding the GIL at hang_kinds\.py:72",
    "ddp_skip": r"all ranks wait in collective #10; rank 3 \(host 10\.\d+\.\d+\.2\) started it "
    r"as barrier\(\), the others as all_reduce\(float32\[10\]\); rank 3 is at hang_kinds\.py:59",
}


KINDS = [*EXPECTED, "shape"]
PER_HOST = {"ddp_skip": 2}
"""Ranks per host where 1 is not enough (see the module's docstring)."""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    """Every kind of hang at once on one cluster (each job mostly waits for its
    timeout, so together they take little more than one): kind -> its job."""
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        started = {
            kind: Job.start(cluster, kind, tmp_path_factory.mktemp(kind), 29560 + i)
            for i, kind in enumerate(KINDS)
        }
        for job in started.values():
            job.wait()
        yield started


class Job:
    """One job of 2 launchers (one per host) and what came of it."""

    def __init__(self, cluster: EmulatedCluster, out: Path, procs: list) -> None:
        self.cluster, self.out, self.procs = cluster, out, procs
        self.codes: list[int] = []
        self.stderr: list[str] = []
        self.verdict_at = 0.0

    @classmethod
    def start(cls, cluster: EmulatedCluster, kind: str, out: Path, port: int) -> Job:
        procs = [
            cluster.popen(
                i,
                [
                    sys.executable, "-m", "manygpu", "launch", "--nnodes", "2",
                    "--node-rank", str(i), "--nproc-per-node", str(PER_HOST.get(kind, 1)),
                    "--master-addr", cluster.addresses[0], "--master-port", str(port),
                    "--timeout", str(TIMEOUT), "--term-timeout", "3", str(SCRIPT), kind, str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=subprocess_env(namespace=True),
                start_new_session=True,
            )
            for i in range(2)
        ]  # fmt: skip
        return cls(cluster, out, procs)

    def wait(self) -> None:
        try:
            for proc in self.procs:
                self.stderr.append(proc.communicate(timeout=240)[1])
                self.codes.append(proc.returncode)
        finally:
            for proc in self.procs:
                proc.kill()
        self.verdict_at = time.time()


def _evidence(job: Job) -> Path:
    """The evidence directory the store's host named."""
    line = next(ln for ln in job.stderr[0].splitlines() if ln.startswith("manygpu: evidence ("))
    return Path(line.rsplit(": ", 1)[1])


def _verdict_delay(job: Job) -> float:
    """Seconds from when the store's host's ranks began to wait (their watchers'
    record of it) to the verdict (verdict.json written)."""
    where = _evidence(job)
    docs = [json.loads(p.read_text()) for p in where.glob("progress-rank*.json")]
    # A rank stopped after the verdict may have written that its wait ended.
    waits = [d["waiting"] or d.get("waited") for d in docs]
    began = [w["since"] for w in waits if w]
    return (where / "verdict.json").stat().st_mtime - min(began)


def _left(out: Path, ranks: int) -> list[int]:
    deadline = time.monotonic() + 10
    pids = [int(p.read_text()) for p in out.glob("pid*")]
    assert len(pids) == ranks, pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_the_verdict_names_the_rank_its_host_and_its_line(jobs: dict[str, Job], kind: str) -> None:
    job = jobs[kind]
    serving = job.stderr[0]
    lines = [line for line in serving.splitlines() if line.startswith("manygpu: hang: ")]
    assert len(lines) == 1, serving[-3000:]
    assert re.fullmatch("manygpu: hang: " + EXPECTED[kind], lines[0]), lines[0]
    assert job.codes == [124, 124], [err[-1500:] for err in job.stderr]
    # From the moment the ranks began to wait (training before it takes what the
    # load allows) to the verdict.
    took = _verdict_delay(job)
    assert took < TIMEOUT + 10, f"the verdict came {took:.1f}s after the wait began"
    assert _left(job.out, 2 * PER_HOST.get(kind, 1)) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_rank_that_aborts_on_a_shape_mismatch_is_named_with_its_line(
    jobs: dict[str, Job],
) -> None:
    """gloo aborts the process on a size mismatch: not a hang but a crash; the first
    failure is named, with the line faulthandler saw it at."""
    job = jobs["shape"]
    report = [line for line in job.stderr[1].splitlines() if line.startswith("manygpu: ")]
    assert report[0].startswith("manygpu: rank 1 was killed by SIGABRT"), report
    assert report[0].endswith(" at hang_kinds.py:75"), report
    assert _left(job.out, 2) == []
