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
