"""mpirun as the outer launcher: one ``manygpu launch`` per emulated host, told its node by MPI.

mpirun itself is not installed here, so each host's launcher gets the
environment Open MPI gives a process started by ``mpirun --map-by ppr:1:node
-x MASTER_ADDR=<host 0> manygpu launch ...`` (rank = node, one rank per node,
the job id). The 2 hosts x 1 process must train exactly as one process
(max |difference| < 1e-5, fp32 SGD). One process per host: what MPI tells a
launcher is its node (rank, count, where to meet); a launcher's several local
processes under an outer launcher are test_slurm_real.py's sbatch job (2 x 2),
and each rank process costs ~2.5 CPU-s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from jobs import subprocess_env
from reference import reference_train

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPT = Path(__file__).parent / "scripts" / "strategy_equivalence.py"


def _open_mpi(rank: int, size: int, master: str) -> list[str]:
    """What Open MPI's mpirun -x MASTER_ADDR sets for rank ``rank`` (one per node)."""
    return [
        f"OMPI_COMM_WORLD_RANK={rank}",
        f"OMPI_COMM_WORLD_SIZE={size}",
        "OMPI_COMM_WORLD_LOCAL_RANK=0",
        "OMPI_COMM_WORLD_LOCAL_SIZE=1",
        "OMPI_MCA_ess_base_jobid=2730164225",
        f"MASTER_ADDR={master}",
    ]


@pytest.mark.timeout(240)
def test_one_launcher_per_node_from_mpirun_matches_one_process(tmp_path: Path) -> None:
    steps, batch = 4, 12
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        master = cluster.addresses[0]
        argv = [
            [
                "env",
                *_open_mpi(i, 2, master),
                sys.executable,
                "-m",
                "manygpu",
                "launch",
                "--nproc-per-node",
                "1",
                "--timeout",
                "60",
                str(SCRIPT),
                str(tmp_path),
                str(steps),
                str(batch),
                "ddp",
            ]
            for i in range(2)
        ]
        results = cluster.run_all(argv, timeout=200, env=subprocess_env(namespace=True))
    for node, res in enumerate(results):
        assert res.returncode == 0, f"node {node}:\n{res.stderr[-3000:]}"
    ref = reference_train(steps, batch)
    records = [torch.load(tmp_path / f"ddp-rank{r}.pt", weights_only=True) for r in range(2)]
    for rank, rec in enumerate(records):
        assert rec["world"] == 2 and rec["node"] == rank  # the MPI rank is the node's
        assert rec["master_addr"] == "127.0.0.1"  # the node's door to the gated store
        assert (rec["params"] - ref).abs().max().item() < 1e-5
