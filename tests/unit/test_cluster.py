"""Cluster detection from plain environment dictionaries, and Slurm host lists."""

from __future__ import annotations

import zlib

import pytest

from manygpu.errors import UsageError
from manygpu.runtime.cluster import DEFAULT_PORT, ClusterInfo, detect_cluster
from manygpu.runtime.hostlist import expand_hostlist

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0.cluster",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job-42",
}

# What srun gives task 6 of `srun -N4 --ntasks-per-node=4` (global rank 6 = node 1, local 2).
SLURM_STEP = {
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "4",
    "SLURM_JOB_NODELIST": "gpu[01-04]",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS_PER_NODE": "4(x4)",
}

OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
}


def test_torchrun_environment() -> None:
    info = detect_cluster(TORCHRUN)
    assert info == ClusterInfo(
        source="torchelastic",
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="node0.cluster",
        master_port=29400,
    )
    assert info.distributed and not info.is_main


def test_rank_and_world_without_run_id_is_plain_env() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    info = detect_cluster(env)
    assert info.source == "env"
    assert (info.local_world_size, info.master_port) == (2, 1234)


def test_slurm_srun_step() -> None:
    info = detect_cluster(SLURM_STEP)
    assert info.source == "slurm"
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (6, 16, 2, 1)
    assert info.local_world_size == 4
    assert info.master_addr == "gpu01"
    assert info.master_port == 20000 + zlib.crc32(b"123456.0") % 10000


def test_slurm_port_is_deterministic_per_job_step() -> None:
    """Every task of a step meets on one port; other jobs and other steps of this job
    (two ``srun`` at once on a node) on others."""
    other_task = SLURM_STEP | {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    other_job = SLURM_STEP | {"SLURM_JOB_ID": "123457"}
    port = detect_cluster(SLURM_STEP).master_port
    assert detect_cluster(other_task).master_port == port
    assert detect_cluster(other_job).master_port != port
    steps = {detect_cluster(SLURM_STEP | {"SLURM_STEP_ID": str(s)}).master_port for s in range(8)}
    assert len(steps) == 8
    assert 20000 <= port < 30000


def test_slurm_master_addr_and_port_from_env_win() -> None:
    info = detect_cluster(SLURM_STEP | {"MASTER_ADDR": "login7", "MASTER_PORT": "31000"})
    assert (info.master_addr, info.master_port) == ("login7", 31000)


def test_slurm_batch_script_without_step_is_single() -> None:
    batch = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}
    batch |= {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    info = detect_cluster(batch)
    assert info.source == "single"
    assert (info.rank, info.world_size) == (0, 1)


def test_torchrun_inside_slurm_allocation_wins() -> None:
    info = detect_cluster(SLURM_STEP | TORCHRUN)
    assert info.source == "torchelastic"
    assert (info.rank, info.world_size, info.master_addr) == (5, 8, "node0.cluster")


def test_slurm_heterogeneous_tasks_per_node() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "6",
        "SLURM_LOCALID": "3",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_TASKS_PER_NODE": "2,4",
    }
    assert detect_cluster(env).local_world_size == 4


def test_a_step_smaller_than_its_allocation_counts_its_own_tasks_and_nodes() -> None:
    """`srun -N1 -n2` inside `sbatch -N2 -n8`: the allocation's counts are not the job's."""
    env = {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "8",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_STEP_NODELIST": "gpu02",
        "SLURM_JOB_ID": "78",
        "SLURM_STEP_ID": "1",
    }
    info = detect_cluster(env)
    assert (info.world_size, info.local_world_size, info.master_addr) == (2, 2, "gpu02")


def test_slurm_tasks_per_node_repeats_and_mixes() -> None:
    """``2(x3),1``: three nodes of 2 tasks, then one of 1 (the last node's local world is 1)."""
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "3",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NODELIST": "n[1-4]",
        "SLURM_JOB_ID": "79",
        "SLURM_STEP_ID": "0",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
    }
    assert detect_cluster(env).local_world_size == 1
    assert detect_cluster(env | {"SLURM_NODEID": "2", "SLURM_PROCID": "4"}).local_world_size == 2


def test_openmpi() -> None:
    info = detect_cluster(OPENMPI)
    assert info.source == "mpi"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert info.node_rank == 1
    assert (info.master_addr, info.master_port) == ("10.0.0.1", DEFAULT_PORT)


def test_mpich() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
    info = detect_cluster(env)
    assert info.source == "mpi"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (2, 4, 2, 4)
    assert info.master_addr == "127.0.0.1"  # one node: loopback is fine


def test_multi_node_mpi_without_master_addr_raises() -> None:
    env = {k: v for k, v in OPENMPI.items() if k != "MASTER_ADDR"}
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        detect_cluster(env)


def test_empty_environment_is_single() -> None:
    info = detect_cluster({})
    assert info.source == "single"
    assert (info.rank, info.world_size, info.local_rank) == (0, 1, 0)
    assert info.is_main and not info.distributed


def test_rank_outside_world_raises() -> None:
    with pytest.raises(UsageError, match="rank 4 is outside world size 4"):
        detect_cluster({"RANK": "4", "WORLD_SIZE": "4"})


def test_local_rank_outside_local_world_raises() -> None:
    with pytest.raises(UsageError, match="local rank"):
        detect_cluster({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[1-3],gpu[08-09]", ["node1", "node2", "node3", "gpu08", "gpu09"]),
        ("a,b", ["a", "b"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("n[1-2,5,07-08]", ["n1", "n2", "n5", "n07", "n08"]),
        ("login1", ["login1"]),
        (" c[1-2] ", ["c1", "c2"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts
