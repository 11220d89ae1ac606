"""A job started directly by srun on two emulated hosts (no ``manygpu launch``):
rank 0's store is reachable only through its gate, so the ranks need the job's
secret; without it the job stops in one line, and a stranger gets nothing.

srun is not installed here: each rank is started in its host's namespace with
the variables ``srun -N2 --ntasks-per-node=1`` gives a task
(tests/unit/test_cluster.py pins how they are read).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import subprocess_env

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "launch" / "scripts" / "direct_job.py"
ATTACK = ROOT / "tests" / "helpers" / "rdzv_attack.py"
PORT = 29611
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "MASTER_")


def _srun_task(rank: int, master: str, secret: bool) -> dict[str, str]:
    env = {
        k: v
        for k, v in subprocess_env(namespace=True).items()
        if not k.startswith(LAUNCHER_PREFIXES)
    }
    if not secret:
        del env["MANYGPU_JOB_SECRET"]
    return env | {
        "SLURM_JOB_ID": "777",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": str(rank),
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "MASTER_ADDR": master,
        "MASTER_PORT": str(PORT),
    }


def _start(cluster: EmulatedCluster, out: Path, secret: bool) -> list[subprocess.Popen[str]]:
    return [
        cluster.popen(
            rank,
            [sys.executable, str(JOB), str(out), "group"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_srun_task(rank, cluster.addresses[0], secret),
        )
        for rank in range(2)
    ]


def _wait_ready(out: Path, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 90
    while not all((out / f"ready{r}").exists() for r in range(2)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise AssertionError([p.communicate()[1][-2000:] for p in procs])
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_srun_started_ranks_meet_through_the_gate_and_strangers_get_nothing(
    tmp_path: Path,
) -> None:
    with_secret, without = tmp_path / "with", tmp_path / "without"
    with_secret.mkdir()
    without.mkdir()
    marker = tmp_path / "stranger-ran"
    with EmulatedCluster(3, LinkShape(rate="1gbit")) as cluster:
        refused = _start(cluster, without, secret=False)
        refused_out = [p.communicate(timeout=60) for p in refused]
        procs = _start(cluster, with_secret, secret=True)
        try:
            _wait_ready(with_secret, procs)
            env = subprocess_env(namespace=True)
            del env["MANYGPU_JOB_SECRET"]
            argv = [sys.executable, str(ATTACK), "--probe", cluster.addresses[0], str(PORT)]
            probe = subprocess.run(
                cluster.command(2, [*argv, str(marker)]),
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
            (with_secret / "go").touch()
            results = [p.communicate(timeout=60) for p in procs]
        finally:
            for p in procs:
                p.kill()
    for p, (_, err) in zip(refused, refused_out, strict=True):
        assert p.returncode != 0
        lines = [line for line in err.splitlines() if "MANYGPU_JOB_SECRET" in line]
        assert len(lines) == 1 and "network address" in lines[0], err[-2000:]
    seen = json.loads(probe.stdout)
    assert not seen["connected"] and not seen["keys"], seen
    assert not marker.exists()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert [(with_secret / f"done{r}").read_text() for r in range(2)] == ["3.0", "3.0"]
    assert f"refused a connection to the job's store from {cluster.addresses[2]}" in results[0][1]
