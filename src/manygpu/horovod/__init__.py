"""Horovod's PyTorch API on torch.distributed: change one line of a Horovod script.

::

    import manygpu.horovod as hvd        # was: import horovod.torch as hvd

    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

and run it with ``manygpu launch --nproc-per-node N script.py`` (or torchrun,
srun, mpirun). Collectives go through torch.distributed (NCCL for CUDA
tensors, gloo for CPU ones) with manygpu's timeouts: a mismatch between ranks
is an error naming them, a stall names the missing ranks. What of Horovod is
left out (Adasum, elastic...) raises an error that says what to
use instead; the list is :data:`manygpu.horovod.missing.LEFT_OUT`.

This package is imported only when asked for: ``import manygpu`` does not load it.

How a call runs
---------------
A call of the API (``allreduce_async``, ``barrier``, a DistributedOptimizer
bucket, ``hvd.join``, ``hvd.init``'s process sets...) goes down one path,
scope -> agree -> match -> join -> start, and no step calls back up it:

1. scope (:mod:`~manygpu.horovod.process_sets`): ``process_set=`` resolved to a
   :class:`~manygpu.horovod.basics.Scope` (the ranks, the sub-group, this rank's place).
   Owns the registered process sets.
2. agree (:mod:`~manygpu.horovod.checks`): every rank checks that the others make
   the same call, before anything is sent; no state of its own.
3. match (:mod:`~manygpu.horovod.matching`): on the whole job, a round in which
   named calls meet by name, as Horovod's coordinator matches them; a named call
   waits here until every rank has made it. Owns the names of pending calls and
   the deferred ones.
4. join (:mod:`~manygpu.horovod.joining`): what the call asks of ranks in
   ``hvd.join()`` (zeros, a barrier) or its refusal. Owns the joins: who has joined
   as of the last round, and the optimizers a joined rank stands in for.
5. start (:mod:`~manygpu.horovod.pending`): the collective is started and its works
   held under an integer handle until ``synchronize``. Owns the pending calls.

A step imports only the steps after it. A named call on the whole job is handed
to match first (``matching.launch``), with what starts it: its agree and join
steps run once every rank has made it, from that closure, not from an import
back up the path.

Beneath the path, read by every step: :mod:`~manygpu.horovod.basics` (the session:
topology, process group, timeout; nothing else) and :mod:`~manygpu.horovod.reports`
(how errors name calls, mismatches and stalls; owns the call numbers a stall
compares). Each owner keeps its state in the session (``basics.owned``), so it
lives and dies with ``hvd.init``/``hvd.shutdown``, and only its own module changes
it. Above the path are the calls themselves: the operations (``reduce_ops``,
``data_ops``, ``grouped``, ``sparse``, ``functions``, ``differentiable``, the
optimizer), ``handles`` (``poll``, ``synchronize``), ``stand_in`` (``hvd.join``'s
own loop) and ``lifecycle`` (``hvd.init``). ``tests/unit/test_horovod_layout.py``
checks the order and the owners.
"""

from manygpu.horovod.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from manygpu.horovod.compression import Compression, Compressor, FP16Compressor, NoneCompressor
from manygpu.horovod.data_ops import (
    allgather_async,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
)
from manygpu.horovod.differentiable import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allreduce,
    reducescatter,
)
from manygpu.horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from manygpu.horovod.functions import allgather_object, broadcast_object, broadcast_parameters
from manygpu.horovod.grouped import (
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
)
from manygpu.horovod.handles import poll, synchronize
from manygpu.horovod.joining import JoinedRankError
from manygpu.horovod.lifecycle import init
from manygpu.horovod.missing import LEFT_OUT, NotSupportedError, not_supported
from manygpu.horovod.optimizer import DistributedOptimizer
from manygpu.horovod.optimizer_state import broadcast_optimizer_state
from manygpu.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from manygpu.horovod.reduce_ops import (
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    reducescatter_async,
)
from manygpu.horovod.reports import HorovodMismatchError
from manygpu.horovod.sparse import sparse_allreduce_async
from manygpu.horovod.stand_in import join


def __getattr__(name: str) -> object:
    """Horovod names left out: an error that says what to use instead (PEP 562)."""
    if name in LEFT_OUT:
        not_supported(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Average",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "FP16Compressor",
    "HorovodInternalError",
    "HorovodMismatchError",
    "HostsUpdatedInterrupt",
    "JoinedRankError",
    "Max",
    "Min",
    "NoneCompressor",
    "NotSupportedError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "synchronize",
]
