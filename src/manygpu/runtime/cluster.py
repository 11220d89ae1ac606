"""Detect how this process was started: torchrun, Slurm, MPI, or alone.

Detected in that order, as Lightning Fabric does, because a torchrun worker
inside a Slurm allocation must follow torchrun's variables, not Slurm's.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime.env import Environ
from manygpu.runtime.hostlist import expand_hostlist

DEFAULT_PORT = 29500


@dataclass(frozen=True, kw_only=True)
class ClusterInfo:
    """This process's place in the job."""

    source: str
    """Which launcher set the job up: torchelastic, slurm, mpi or single."""
    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes of this node; picks the GPU."""
    local_world_size: int
    """Processes on this node; used to split CPU threads."""
    node_rank: int
    """Index of this node."""
    master_addr: str
    """Host of the rendezvous store."""
    master_port: int
    """Port of the rendezvous store."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise UsageError(
                f"rank {self.rank} is outside world size {self.world_size} "
                f"(from {self.source}); check the launcher's environment"
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise UsageError(
                f"local rank {self.local_rank} is outside local world size "
                f"{self.local_world_size} (from {self.source})"
            )

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs and writes files."""
        return self.rank == 0


def _from_torchelastic(env: Environ) -> ClusterInfo | None:
    if envmod.get_str(env, "RANK") is None or envmod.get_str(env, "WORLD_SIZE") is None:
        return None
    world = envmod.get_int(env, "WORLD_SIZE") or 1
    local_world = envmod.get_int(env, "LOCAL_WORLD_SIZE") or world
    return ClusterInfo(
        source="torchelastic" if "TORCHELASTIC_RUN_ID" in env else "env",
        rank=envmod.get_int(env, "RANK") or 0,
        world_size=world,
        local_rank=envmod.get_int(env, "LOCAL_RANK") or 0,
        local_world_size=local_world,
        node_rank=envmod.get_int(env, "GROUP_RANK", "NODE_RANK") or 0,
        master_addr=envmod.get_str(env, "MASTER_ADDR") or "127.0.0.1",
        master_port=envmod.get_int(env, "MASTER_PORT") or DEFAULT_PORT,
    )


def slurm_master(env: Environ) -> tuple[str, int]:
    """Master address (the step's first host) and a port from the job and step ids."""
    # The step's nodes first: `srun -w b,c` inside an allocation of a,b,c must
    # meet on b, where a task runs, not on the allocation's first node.
    nodelist = envmod.get_str(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    addr = envmod.get_str(env, "MASTER_ADDR") or (
        expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1"
    )
    port = envmod.get_int(env, "MASTER_PORT")
    if port is None:
        # Same job and step -> same port on every node of the step, spread over
        # 10000 ports so two jobs sharing a node rarely collide; the step id keeps
        # steps of one job apart (`srun ... &` twice, a sweep of steps on one
        # node, a step right after one whose port is still in TIME_WAIT).
        job = envmod.get_str(env, "SLURM_JOB_ID", "SLURM_JOBID") or "0"
        step = envmod.get_str(env, "SLURM_STEP_ID", "SLURM_STEPID")
        key = job if step is None else f"{job}.{step}"
        port = 20000 + zlib.crc32(key.encode()) % 10000
    return addr, port


def _from_slurm(env: Environ) -> ClusterInfo | None:
    if envmod.get_str(env, "SLURM_PROCID") is None or envmod.get_str(env, "SLURM_NTASKS") is None:
        return None
    # A batch script itself (not started by srun) also has SLURM_PROCID=0 and
    # SLURM_NTASKS=N; only trust it when srun started this step.
    if envmod.get_str(env, "SLURM_STEP_ID", "SLURM_STEPID") is None:
        return None
    # The step's counts first: `srun -N1 -n2` inside a 2-node allocation is a job of 2.
    world = envmod.get_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or 1
    nnodes = envmod.get_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    per_node = envmod.get_str(
        env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"
    )
    node_id = envmod.get_int(env, "SLURM_NODEID") or 0
    local_world = _count_for_node(per_node or "", node_id) or max(world // nnodes, 1)
    addr, port = slurm_master(env)
    return ClusterInfo(
        source="slurm",
        rank=envmod.get_int(env, "SLURM_PROCID") or 0,
        world_size=world,
        local_rank=envmod.get_int(env, "SLURM_LOCALID") or 0,
        local_world_size=local_world,
        node_rank=node_id,
        master_addr=addr,
        master_port=port,
    )


def _count_for_node(tasks_per_node: str, node_id: int) -> int | None:
    """Slurm's compressed tasks-per-node (``'4(x2),2'``) for node ``node_id``."""
    counts: list[int] = []
    for item in filter(None, tasks_per_node.split(",")):
        count, _, repeat = item.partition("(x")
        if not count.isdigit():
            return None
        counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
    return counts[node_id] if node_id < len(counts) else None


_MPI_VARS = {
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "pmix": ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
}


def mpi_ranks(env: Environ) -> tuple[int, int, int, int] | None:
    """(rank, size, local rank, local size) when an MPI launcher started this process."""
    for rank_var, size_var, lrank_var, lsize_var in _MPI_VARS.values():
        if envmod.get_str(env, rank_var) is None or envmod.get_str(env, size_var) is None:
            continue
        world = envmod.get_int(env, size_var) or 1
        return (
            envmod.get_int(env, rank_var) or 0,
            world,
            envmod.get_int(env, lrank_var) or 0,
            envmod.get_int(env, lsize_var) or world,
        )
    return None


def mpi_port(env: Environ) -> int:
    """``MASTER_PORT``, else a port from the MPI job's id (the same on every node)."""
    port = envmod.get_int(env, "MASTER_PORT")
    if port is not None:
        return port
    job = envmod.get_str(env, "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")
    return 20000 + zlib.crc32(job.encode()) % 10000 if job else DEFAULT_PORT


def _from_mpi(env: Environ) -> ClusterInfo | None:
    ranks = mpi_ranks(env)
    if ranks is None:
        return None
    rank, world, local_rank, local_world = ranks
    addr = envmod.get_str(env, "MASTER_ADDR")
    if addr is None and local_world < world:
        raise UsageError(
            "MPI job spans several nodes but MASTER_ADDR is not set; "
            "export MASTER_ADDR=<first node> (e.g. mpirun -x MASTER_ADDR=host0)"
        )
    return ClusterInfo(
        source="mpi",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=rank // max(local_world, 1),
        master_addr=addr or "127.0.0.1",
        master_port=envmod.get_int(env, "MASTER_PORT") or DEFAULT_PORT,
    )


def _single() -> ClusterInfo:
    return ClusterInfo(
        source="single",
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=DEFAULT_PORT,
    )


def detect_cluster(env: Environ | None = None) -> ClusterInfo:
    """This process's place in the job, from its environment.

    Args:
        env: environment to read; this process's when ``None``.
    """
    env = envmod.current() if env is None else env
    for probe in (_from_torchelastic, _from_slurm, _from_mpi):
        info = probe(env)
        if info is not None:
            return info
    return _single()
