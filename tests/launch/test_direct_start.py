"""A job started directly by srun or mpirun (no ``manygpu launch``): rank 0's store listens
on the job's address only (loopback on one node), never on every address of the machine.

srun and mpirun are not installed here: each rank is started with the variables
they give a task (as tests/unit/test_cluster.py and tests/cluster/test_mpirun_outer.py
write them). While the group is up, the test reads rank 0's listening sockets.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from jobs import subprocess_env

SCRIPT = Path(__file__).parent / "scripts" / "direct_job.py"
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _slurm(rank: int, port: int) -> dict[str, str]:
    """What ``srun -N1 -n2`` gives task ``rank``; the master is the step's node, by name."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_STEP_NODELIST": socket.gethostname(),
        "MASTER_PORT": str(port),
    }


def _open_mpi(rank: int, port: int) -> dict[str, str]:
    """What ``mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT`` gives rank ``rank``."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _env(style: str, rank: int, port: int) -> dict[str, str]:
    base = {k: v for k, v in subprocess_env().items() if not k.startswith(LAUNCHER_PREFIXES)}
    base |= {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return base | (_slurm(rank, port) if style == "slurm" else _open_mpi(rank, port))


def _listening(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid == pid
    ]


def _wait_for_ready(out: Path, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 90
    while not all((out / f"ready{r}").exists() for r in range(len(procs))):
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            errs = [p.communicate()[1][-2000:] for p in procs]
            raise AssertionError(f"the job never came up: {errs}")
        time.sleep(0.1)


# Both kinds of job reach the store through the same shared_store -> job_store, and
# store_host treats Slurm and MPI alike: Slurm's default group and Open MPI's
# parameter-server links cover both launchers and both kinds (each rank's variables
# are read by tests/unit/test_cluster.py).
@pytest.mark.timeout(180)
@pytest.mark.parametrize("style, what", [("slurm", "group"), ("openmpi", "ps")])
def test_a_direct_start_stores_on_loopback_only(tmp_path: Path, style: str, what: str) -> None:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path), what],
            env=_env(style, rank, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        _wait_for_ready(tmp_path, procs)
        store = [ip for ip, p in _listening(procs[0].pid) if p == port]
        others = [entry for proc in procs for entry in _listening(proc.pid)]
        (tmp_path / "go").touch()
        errs = [proc.communicate(timeout=90)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], errs
    assert (tmp_path / "ready0").read_text() == ("slurm" if style == "slurm" else "mpi")
    expected = "3.0"
    assert [(tmp_path / f"done{r}").read_text() for r in range(2)] == [expected, expected]
    assert store == ["127.0.0.1"], f"rank 0's store (port {port}) listens on {store}"
    wildcard = [entry for entry in others if entry[0] in ("0.0.0.0", "::")]
    assert not wildcard, f"listening on every address: {wildcard}"
