"""Who this process is in a Horovod-style job: ``init``, ``shutdown``, sizes and ranks.

Horovod's API is a set of module functions over one hidden session, so this
module keeps one: the job's topology, the process group it joined, the
collective timeout and the table of pending asynchronous operations. It is
created by :func:`init` and dropped by :func:`shutdown`; nothing else writes it.

``init`` reads the job from the launcher's environment (``manygpu launch``,
torchrun, Slurm, MPI) through :mod:`manygpu.runtime`, and creates the default
process group there: gloo when there is no CUDA, and ``cpu:gloo,cuda:nccl``
when there is (CUDA tensors over NCCL, CPU tensors, such as the metrics
Horovod's examples average, over gloo). It pins no device: a Horovod script
calls ``torch.cuda.set_device(hvd.local_rank())`` itself, and the group is not
bound to a device, so NCCL builds its communicator on the device of the first
CUDA tensor it is given, the one the script pinned.
"""

from __future__ import annotations

import atexit
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from manygpu.comm.common import active, all_gather_single, wait
from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import ClusterInfo, detect_cluster
from manygpu.runtime.device import set_cpu_threads
from manygpu.runtime.process_group import DistContext, init_distributed, teardown

if TYPE_CHECKING:
    from manygpu.horovod.process_sets import Scope, SetTable


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


@dataclass
class Pending:
    """An asynchronous operation: the backend's works and what turns them into the result."""

    works: list[dist.Work]
    finish: Callable[[], Any]
    """Run once every work is done: scaling, trimming, copying back; returns the result."""
    description: str
    """How errors name it: ``allreduce('loss', float32[4], op=Average)``."""
    seq: int
    """This rank's number for the call, shown when a stall is reported."""
    scope: Scope | None = None
    """The process set it runs in; ``None`` for the whole job."""
    name: str | None = None
    """Horovod's name for it (``allreduce.loss``) while pending, when the user gave one."""
    start: Callable[[], Any] | None = None
    """A named call not started yet: what starts it once every rank has made it
    (:mod:`manygpu.horovod.matching`); ``None`` once started."""
    error: Exception | None = None
    """Why starting it failed (alike on every rank); ``synchronize`` raises it."""
    parts: list[int] | None = None
    """A grouped call's merged handle: the parts' handles, which ``poll`` asks (a named
    part may start after the merged handle was made)."""


@dataclass
class Session:
    """What ``hvd.init()`` set up, alive until ``hvd.shutdown()``."""

    topology: Topology
    ctx: DistContext
    timeout_s: float
    """Bound on every collective (``MANYGPU_TIMEOUT``, else manygpu's default)."""
    calls: int = 0
    """Collectives this rank has started through manygpu.horovod."""
    pending: dict[int, Pending] = field(default_factory=dict)
    handles: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    """Horovod's handles are integers; the next one."""
    stand_ins: list[Any] = field(default_factory=list)
    """Weak references to the whole job's DistributedOptimizers' gradient syncs, in the
    order built (the same on every rank): a rank in ``hvd.join()`` stands in for the
    buckets of the one the others step (:mod:`manygpu.horovod.joining`)."""
    names: set[str] = field(default_factory=set)
    """Names of the pending operations: Horovod refuses a second call with one of them."""
    deferred: dict[str, int] = field(default_factory=dict)
    """Named calls made here but not yet by every rank: name -> handle, in call order."""
    meeting: bool = False
    """Whether this rank is matching named calls now (the calls it starts then do not)."""
    joined: list[int] = field(default_factory=list)
    """Ranks in ``hvd.join()`` as of this rank's last round (:mod:`manygpu.horovod.
    matching`): process-set calls are refused meanwhile (a joined rank waits in rounds
    of the whole job only)."""
    process_sets: SetTable | None = None
    """The registered process sets (:mod:`manygpu.horovod.process_sets`)."""

    def next_call(self) -> int:
        self.calls += 1
        return self.calls


_session: Session | None = None
_exit_hook = False


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


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job the launcher started (a second call does nothing, as in Horovod).

    Args:
        comm: Horovod's MPI communicator or rank list: not supported; start
            only the processes you want instead.
        process_sets: ``hvd.ProcessSet`` objects to register, in order (ids 1, 2, ...),
            or ``"dynamic"`` to allow ``hvd.add_process_set`` later.
    """
    global _session, _exit_hook
    if comm is not None:
        raise UsageError(
            "hvd.init(comm=...) is not supported: manygpu.horovod joins every process the "
            "launcher started; start only the ones you want (manygpu launch -np N), or use "
            "torch.distributed.new_group(ranks) for a subgroup"
        )
    if _session is not None:
        return
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
    from manygpu.horovod import process_sets as sets  # it builds on this module

    try:
        sets.setup(_session, process_sets)
    except BaseException:
        shutdown()  # a bad process set leaves no half-initialized job behind
        raise
    if not _exit_hook:
        atexit.register(shutdown)  # Horovod shuts down at exit too
        _exit_hook = True


def shutdown() -> None:
    """Leave the job: destroy the process group ``init`` created (safe to call twice)."""
    global _session
    if _session is None:
        return
    session, _session = _session, None
    teardown(session.ctx)


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` has not)."""
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


def __getattr__(name: str) -> Any:
    """``global_process_set`` and ``check_process_set`` moved to
    :mod:`manygpu.horovod.process_sets` (which builds on this module, so it cannot be
    imported at the top here); the old names still work."""
    if name in ("global_process_set", "check_process_set"):
        from manygpu.horovod import process_sets

        return getattr(process_sets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
