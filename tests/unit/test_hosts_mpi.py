"""mpirun as the outer launcher: one ``manygpu launch`` per node, its MPI rank the node's.

``mpirun --map-by ppr:1:node -x MASTER_ADDR=node0 manygpu launch ...`` (Open MPI;
MPICH and PMIx name the same facts differently). Pure: a fake MPI environment.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from manygpu.errors import UsageError
from manygpu.launch.resolve import LaunchRequest, resolve

OPEN_MPI_NODE_1 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    "OMPI_MCA_ess_base_jobid": "2730164225",
    "MASTER_ADDR": "node0",
}


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_one_launcher_per_node_is_a_static_multi_node_job(script: str) -> None:
    spec = resolve(LaunchRequest(entry=script, nproc_per_node=4), OPEN_MPI_NODE_1, 0)
    port = 20000 + zlib.crc32(b"2730164225") % 10000  # the same on every node
    assert (spec.min_nodes, spec.max_nodes, spec.node_rank) == (3, 3, 1)
    assert (spec.rdzv_backend, spec.rdzv_endpoint) == ("static", f"node0:{port}")
    assert spec.nproc_per_node == 4


def test_mpich_and_pmix_names_and_an_explicit_port(script: str) -> None:
    mpich = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
    spec = resolve(
        LaunchRequest(entry=script), mpich | {"MASTER_ADDR": "h0", "MASTER_PORT": "29555"}, 0
    )
    assert (spec.max_nodes, spec.node_rank, spec.rdzv_endpoint) == (4, 2, "h0:29555")
    pmix = {"PMIX_RANK": "0", "PMIX_SIZE": "2", "PMIX_LOCAL_RANK": "0", "PMIX_LOCAL_SIZE": "1"}
    spec = resolve(
        LaunchRequest(entry=script, master_addr="h0"),
        pmix | {"PMIX_NAMESPACE": "prterun-h0-1@1"},
        0,
    )
    assert (spec.max_nodes, spec.node_rank) == (2, 0)
    assert spec.rdzv_endpoint == f"h0:{20000 + zlib.crc32(b'prterun-h0-1@1') % 10000}"


def test_flags_beat_mpi_and_one_rank_is_no_multi_node_job(script: str) -> None:
    spec = resolve(LaunchRequest(entry=script, nnodes="1"), OPEN_MPI_NODE_1, 0)
    assert spec.max_nodes == 1
    alone = OPEN_MPI_NODE_1 | {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}
    assert resolve(LaunchRequest(entry=script), alone, 0).max_nodes == 1


@pytest.mark.parametrize(
    "change, words",
    [
        (
            {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
            "mpirun started 2 launchers on this node; start one per node "
            "(mpirun --map-by ppr:1:node",
        ),
        ({"MASTER_ADDR": ""}, "pass -x MASTER_ADDR=<first node> to mpirun, or give --master-addr"),
    ],
)
def test_mpi_mistakes_are_one_line(script: str, change: dict[str, str], words: str) -> None:
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        resolve(LaunchRequest(entry=script), OPEN_MPI_NODE_1 | change, 0)
    assert "\n" not in str(info.value)
