"""Who this process is in a Horovod-style job: the session, sizes and ranks.

Horovod's API is a set of module functions over one hidden session, so this
module keeps one, holding only what is global to the job: its topology, the
process group it joined and the collective timeout. The state of each step of
a call (registered process sets, call numbers, pending handles, names, joined
ranks) belongs to the module of that step, which keeps it in the session
through :func:`owned` so that it lives and dies with the session; no other
module reaches it (see the package's docstring for the owners).
:func:`open_session` (called by ``hvd.init``, :mod:`manygpu.horovod.lifecycle`)
creates the session and :func:`shutdown` drops it; nothing else writes it.

``hvd.init`` reads the job from the launcher's environment (``manygpu launch``,
torchrun, Slurm, MPI) through :mod:`manygpu.runtime`, and creates the default
process group there: gloo when there is no CUDA, and ``cpu:gloo,cuda:nccl``
when there is (CUDA tensors over NCCL, CPU tensors, such as the metrics
Horovod's examples average, over gloo). It pins no device: a Horovod script
calls ``torch.cuda.set_device(hvd.local_rank())`` itself, and the group is not
bound to a device, so NCCL builds its communicator on the device of the first
CUDA tensor it is given, the one the script pinned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from manygpu.comm.common import active, all_gather_single, wait
from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import ClusterInfo, detect_cluster
from manygpu.runtime.device import set_cpu_threads
from manygpu.runtime.process_group import DistContext, init_distributed, teardown

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Horovod's view of the job: global, local (this host) and cross (same local rank)."""

    rank: int
    """Global rank, 0..size-1."""
    size: int
    """Processes in the job."""
    local_rank: int
    """Rank among the processes of this host."""
    local_size: int
    """Processes on this host."""
    cross_rank: int
    """Rank among the processes that have this local rank (one per host): the host's index."""
    cross_size: int
    """Processes that have this local rank: the number of hosts in a homogeneous job."""
    homogeneous: bool
    """Whether every host runs the same number of processes."""


@dataclass(frozen=True)
class Scope:
    """Where one collective runs: the whole job (id 0) or a registered process set
    (:mod:`manygpu.horovod.process_sets` resolves ``process_set=`` to one), as this rank
    sees it."""

    set_id: int
    ranks: tuple[int, ...]
    """The set's global ranks, in order: set rank ``i`` is global rank ``ranks[i]``."""
    group: Any
    """The sub-group; ``None`` for the whole job (torch's default group)."""
    me: int
    """This process's global rank."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's rank within the set; -1 outside it."""
        return self.ranks.index(self.me) if self.me in self.ranks else -1

    @property
    def whole(self) -> bool:
        """Whether this is the whole job (the checks and stall notes of the job apply)."""
        return self.set_id == 0

    def set_rank(self, global_rank: int) -> int:
        """A global rank's place in the set (the caller checked it belongs)."""
        return self.ranks.index(global_rank)

    def label(self) -> str:
        return "" if self.whole else f" in process set {self.set_id} (ranks {list(self.ranks)})"


@dataclass(frozen=True)
class Session:
    """What ``hvd.init()`` set up, alive until ``hvd.shutdown()``: what is global to the job."""

    topology: Topology
    ctx: DistContext
    timeout_s: float
    """Bound on every collective (``MANYGPU_TIMEOUT``, else manygpu's default)."""
    owned: dict[type, Any] = field(default_factory=dict)
    """Each owner module's state, by its class (:func:`owned`); dropped with the session."""


_session: Session | None = None


def owned(kind: type[T]) -> T:
    """The live session's instance of an owner's state class, made on first use.

    Only the module defining ``kind`` asks for it (``tests/unit/test_horovod_layout.py``
    checks it): that module is the one place its state changes.
    """
    table = session().owned
    if kind not in table:
        table[kind] = kind()
    state: T = table[kind]
    return state


def whole_job() -> Scope:
    """The whole job as a :class:`Scope` (``hvd.global_process_set``)."""
    topo = session().topology
    return Scope(set_id=0, ranks=tuple(range(topo.size)), group=None, me=topo.rank)


def backend_for(cuda_available: bool) -> str:
    """The default group's backend: NCCL for CUDA tensors when CUDA is there, gloo for CPU ones."""
    return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"


def cross_of(table: Sequence[tuple[int, int]], rank: int) -> tuple[int, int, bool]:
    """``(cross_rank, cross_size, homogeneous)`` from every rank's ``(local_rank, node)``.

    The cross group of a rank is every rank with the same local rank, ordered
    by global rank, as Horovod's cross communicator.
    """
    mine = table[rank][0]
    peers = [r for r, (local, _) in enumerate(table) if local == mine]
    per_node: dict[int, int] = {}
    for _, node in table:
        per_node[node] = per_node.get(node, 0) + 1
    return peers.index(rank), len(peers), len(set(per_node.values())) == 1


def _gather_places(cluster: ClusterInfo, timeout_s: float) -> list[tuple[int, int]]:
    """Every rank's ``(local_rank, node_rank)``: two integers each, never a pickle."""
    mine = torch.tensor([[cluster.local_rank, cluster.node_rank]], dtype=torch.int64)
    table = mine.new_empty((dist.get_world_size(), 2))
    wait(all_gather_single(table, mine, async_op=True), "hvd.init topology", timeout_s)
    return [(int(local), int(node)) for local, node in table.tolist()]


def _topology(cluster: ClusterInfo, timeout_s: float) -> Topology:
    if not active():
        return Topology(
            rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
            homogeneous=True,
        )  # fmt: skip
    rank, size = dist.get_rank(), dist.get_world_size()
    # One small collective at start: exact cross ranks even when hosts run
    # different numbers of processes (Horovod computes them at init as well).
    table = _gather_places(cluster, timeout_s)
    cross_rank, cross_size, homogeneous = cross_of(table, rank)
    return Topology(
        rank=rank,
        size=size,
        local_rank=cluster.local_rank,
        local_size=cluster.local_world_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        homogeneous=homogeneous,
    )


def open_session() -> None:
    """Join the job the launcher started and create the session (``hvd.init``'s first half;
    :mod:`manygpu.horovod.lifecycle` registers the process sets after it)."""
    global _session
    environ = envmod.current()
    cluster = detect_cluster(environ)
    timeout_s = envmod.timeout_s(environ)
    cuda = torch.cuda.is_available()
    if not cuda:
        set_cpu_threads(cluster.local_world_size, environ)  # N ranks x all cores thrash a CPU
    # device=cpu: the group is bound to no GPU (see the module's docstring).
    ctx = init_distributed(
        cluster, device=torch.device("cpu"), backend=backend_for(cuda), timeout_s=timeout_s
    )
    _session = Session(topology=_topology(cluster, timeout_s), ctx=ctx, timeout_s=timeout_s)


def shutdown() -> None:
    """Leave the job: destroy the process group ``hvd.init`` created and drop the session,
    every owner's state with it (safe to call twice)."""
    global _session
    if _session is None:
        return
    session, _session = _session, None
    teardown(session.ctx)


def is_initialized() -> bool:
    """Whether ``hvd.init`` has run (and :func:`shutdown` has not)."""
    return _session is not None


def session() -> Session:
    """The live session; Horovod's error when ``init`` was not called."""
    if _session is None:
        raise UsageError("manygpu.horovod has not been initialized; call hvd.init() first")
    return _session


def size() -> int:
    """Number of processes in the job."""
    return session().topology.size


def rank() -> int:
    """This process's global rank."""
    return session().topology.rank


def local_size() -> int:
    """Number of processes on this host."""
    return session().topology.local_size


def local_rank() -> int:
    """This process's rank on its host: the GPU to pin (``torch.cuda.set_device``)."""
    return session().topology.local_rank


def cross_size() -> int:
    """Number of processes with this local rank (the number of hosts when homogeneous)."""
    return session().topology.cross_size


def cross_rank() -> int:
    """This process's rank among those with its local rank (its host's index)."""
    return session().topology.cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return session().topology.homogeneous


def nccl_built() -> bool:
    """Whether this torch can use NCCL (Horovod: whether it was built with NCCL)."""
    return dist.is_available() and dist.is_nccl_available()


def gloo_built() -> bool:
    """Whether this torch can use gloo."""
    return dist.is_available() and dist.is_gloo_available()


def mpi_built() -> bool:
    """Whether this torch was built with the MPI backend."""
    return dist.is_available() and dist.is_mpi_available()


def cuda_built() -> bool:
    """Whether this torch was built with CUDA."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Whether this torch was built for ROCm."""
    return torch.version.hip is not None


def ddl_built() -> bool:
    """IBM DDL: never (Horovod's flag, kept so scripts that test it run)."""
    return False


def ccl_built() -> bool:
    """oneCCL: never (Horovod's flag, kept so scripts that test it run)."""
    return False


def _backend() -> str:
    return dist.get_backend() if dist.is_initialized() else ""


def gloo_enabled() -> bool:
    """Whether CPU collectives run over gloo in this job."""
    return "gloo" in _backend()


def mpi_enabled() -> bool:
    """Whether collectives run over MPI in this job (never under manygpu launch)."""
    return "mpi" in _backend()


def mpi_threads_supported() -> bool:
    """Horovod's MPI thread-support query: no MPI here, so False."""
    return False
