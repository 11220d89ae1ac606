"""Straggler reports on emulated hosts, under a real DDP training loop (gloo).

One 3-host cluster serves every case:
- 2 hosts x 2 ranks where rank 3 (host 1) sleeps 50 ms in each forward and rank
  1 (host 0)'s loader takes 50 ms per batch: rank 3 is named with "compute" and
  rank 1 with "waits for input", nobody else; where nobody is slow: nobody is
  named over 200 steps (reports every 10 steps, so 20 windows, each a chance
  for a false alarm).
- 3 hosts x 1 rank, host 2's link alone throttled to 100 Mbit/s both ways (tc tbf
  on its veth and its switch port) while the others run at 1 Gbit/s: host 2 is
  named with "network", and no rank is named for compute or input.

The jobs run one after the other, and the uniform and two-culprit cases are one job:
the same ranks train 200 uniform steps under one ``Parallel``, then the two culprits'
160 under another (one start of the 4 ranks instead of two, ~17 s of CPU). Each case
is judged on its own lines and table: the main rank marks the end of the first on
stderr once every rank is done with it, after its verdicts; a false alarm printed
late would still fail the second case (a third line, or a second for one rank).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import subprocess_env

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "scripts" / "straggler_kinds.py"
LINE = re.compile(r"manygpu: straggler: (.*)")
PORTS = {"uniform,mixed": 29641, "network": 29644}
DONE = "straggler_kinds: {} done"
"""What the main rank prints once every rank finished a case of a multi-case job."""


class Job:
    """One job: a launcher per host it uses, and what the serving host printed."""

    def __init__(
        self, cluster: EmulatedCluster, kind: str, hosts: int, ranks: int, steps: str, out: Path
    ) -> None:
        self.kind, self.out = kind, out
        port = PORTS[kind]
        self.procs = [
            cluster.popen(
                i,
                [
                    sys.executable, "-m", "manygpu", "launch", "--nnodes", str(hosts),
                    "--node-rank", str(i), "--nproc-per-node", str(ranks),
                    "--master-addr", cluster.addresses[0], "--master-port", str(port),
                    "--timeout", "60", str(SCRIPT), kind, steps, "5" if kind == "network"
                    else "10", str(out),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=subprocess_env(namespace=True),
                start_new_session=True,
            )
            for i in range(hosts)
        ]  # fmt: skip
        self.codes: list[int] = []
        self.output: list[str] = []

    def wait(self) -> Job:
        try:
            for proc in self.procs:
                out, err = proc.communicate(timeout=240)
                self.output.append(out + err)
                self.codes.append(proc.returncode)
                (self.out / f"host{len(self.codes) - 1}.txt").write_text(out + err)
        finally:
            for proc in self.procs:
                proc.kill()
        return self

    def case(self, kind: str) -> Case:
        """One of this job's comma-separated kinds, judged on its own."""
        return Case(self, kind)


class Case:
    """One kind of a job: the job's exit codes and output, and its own lines and table."""

    def __init__(self, job: Job, kind: str) -> None:
        self.job, self.kind = job, kind
        self.codes, self.output = job.codes, job.output

    @property
    def lines(self) -> list[str]:
        """The verdicts the serving host printed during this kind (between the marks)."""
        kinds = self.job.kind.split(",")
        text = self.output[0]
        at = kinds.index(self.kind)
        if at > 0:
            mark = DONE.format(kinds[at - 1])
            assert mark in text, text[-3000:]
            text = text.split(mark, 1)[1]
        if at < len(kinds) - 1:
            mark = DONE.format(self.kind)
            assert mark in text, text[-3000:]
            text = text.split(mark, 1)[0]
        return [m.group(1) for m in LINE.finditer(text)]

    @property
    def table(self) -> list[dict[str, object]]:
        path = self.job.out / f"steps-{self.kind}.json"
        rows: list[dict[str, object]] = json.loads(path.read_text())
        return rows


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Case]]:
    with EmulatedCluster(3, LinkShape(rate="1gbit")) as cluster:
        out = tmp_path_factory.mktemp
        both = Job(cluster, "uniform,mixed", 2, 2, "200,160", out("uniform-mixed")).wait()
        # One after the other: each job's timings are judged, and a job beside it
        # would add its own CPU load. (Run beside the mixed job, host 0's launcher
        # once aborted at its exit: the hang watch's store call, fixed in f5b6bf9.)
        cluster.reshape(2, LinkShape(rate="100mbit"))
        network = Job(cluster, "network", 3, 1, "70", out("network")).wait()
        yield {
            "uniform": both.case("uniform"),
            "mixed": both.case("mixed"),
            "network": network.case("network"),
        }


def _ok(job: Case) -> None:
    assert job.codes == [0] * len(job.codes), "\n".join(o[-2000:] for o in job.output)


HOST0 = r"host 10\.\d+\.\d+\.1"
HOST1 = r"host 10\.\d+\.\d+\.2"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_that_computes_slowly_is_named_with_compute(jobs: dict[str, Case]) -> None:
    job = jobs["mixed"]
    _ok(job)
    mine = [line for line in job.lines if line.startswith("rank 3 ")]
    assert len(mine) == 1, job.output[0][-3000:]
    assert re.fullmatch(
        rf"rank 3 \({HOST1}\) computes \d+\.\dx as long as the median \(input [\d.]+ ms, "
        r"compute [5-9]\d ms vs [\d.]+ ms\)",
        mine[0],
    ), mine
    slow = next(r for r in job.table if r["rank"] == 3)
    assert float(slow["compute_ms"]) > 45, slow  # type: ignore[arg-type]
    fast = next(r for r in job.table if r["rank"] == 0)  # waits for both culprits
    assert float(fast["comm_ms"]) > 40, job.table  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_whose_loader_is_slow_is_named_with_input(jobs: dict[str, Case]) -> None:
    job = jobs["mixed"]
    _ok(job)
    mine = [line for line in job.lines if line.startswith("rank 1 ")]
    assert len(mine) == 1, job.output[0][-3000:]
    assert re.fullmatch(
        rf"rank 1 \({HOST0}\) waits for input: [45]\d ms per step vs [\d.]+ ms "
        r"\(median of the others; compute [\d.]+ ms vs [\d.]+ ms\)",
        mine[0],
    ), mine
    assert len(job.lines) == 2, job.lines  # nobody else


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_uniform_job_names_nobody_over_200_steps(jobs: dict[str, Case]) -> None:
    job = jobs["uniform"]
    _ok(job)
    assert job.lines == [], job.lines
    assert sorted(int(r["rank"]) for r in job.table) == [0, 1, 2, 3]  # type: ignore[call-overload]
    # 199 timed steps (the first has no start): windows 0-18 all reached the judge
    assert {r["window"] for r in job.table} == {18}, job.table
    # Long enough that a verdict (3 windows lasting 5 s) could have come, and then some.
    assert 200 * float(job.table[0]["step_ms"]) / 1e3 > 1.5 * 5.0, job.table  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_host_whose_link_alone_is_throttled_is_named_with_network(
    jobs: dict[str, Case],
) -> None:
    job = jobs["network"]
    _ok(job)
    assert len(job.lines) == 1, job.output[0][-3000:]
    assert re.fullmatch(
        r"host 10\.\d+\.\d+\.3: network: exposed communication is \d+% of every step, and its "
        r"link measures [\d.]+x the other hosts' \([\d.]+ ms vs [\d.]+ ms per MiB round trip\)",
        job.lines[0],
    ), job.lines
