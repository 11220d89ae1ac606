"""The out-of-place collectives, differentiable as in Horovod (autograd functions).

Gradients follow Horovod's definitions: ``allreduce``'s gradient is the
all-reduce (same op and factors) of the incoming gradient; ``allgather`` and
``broadcast`` average the incoming gradients over ranks and keep this rank's
rows (the root's, for broadcast; zeros elsewhere); ``alltoall`` sends the
gradients back along the received splits; ``reducescatter`` all-gathers them
(times the number of processes for ``Sum``). Every rank must run the backward
pass, as every rank ran the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from manygpu.horovod.basics import session
from manygpu.horovod.compression import Compression, Compressor
from manygpu.horovod.data_ops import allgather_async, alltoall_async, broadcast_async, send_splits
from manygpu.horovod.handles import synchronize
from manygpu.horovod.process_sets import global_process_set, resolve
from manygpu.horovod.reduce_ops import (
    ReduceOp,
    allreduce_async,
    grouped_allreduce_async,
    reducescatter_async,
    resolve_op,
)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: Any, op: Any, pre: Any, post: Any, process_set: Any
    ) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(
            grad,
            op=ctx.op,
            prescale_factor=ctx.pre,
            postscale_factor=ctx.post,
            process_set=ctx.process_set,
        )
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> torch.Tensor:
    """``tensor`` reduced over every process (Average by default); ``tensor`` is unchanged."""
    resolve(process_set, "allreduce")
    rop = resolve_op(op, average)
    compressed, cctx = compression.compress(tensor)
    reduced = _Allreduce.apply(
        compressed, name, rop, prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(reduced, cctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: Any, op: Any, pre: Any, post: Any, process_set: Any, *tensors: torch.Tensor
    ) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        handle = grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        reduced = grouped_allreduce(
            list(grads), op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post,
            process_set=ctx.process_set,
        )  # fmt: skip
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced over every process, in as few collectives as dtypes."""
    resolve(process_set, "grouped_allreduce")
    rop = resolve_op(op, average)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(
        name, rop, prescale_factor, postscale_factor, process_set, *[c for c, _ in packed]
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, packed, strict=True)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, process_set: Any) -> Any:
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=ReduceOp.Average, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], device=grad.device), process_set=ctx.process_set)
        offset = sum(rows.tolist()[: resolve(ctx.process_set, "allgather").rank])
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: object = global_process_set
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (dim 0 may differ)."""
    resolve(process_set, "allgather")
    return _Allgather.apply(tensor, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: Any, name: Any, process_set: Any) -> Any:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=ReduceOp.Average, process_set=ctx.process_set)
        if session().topology.rank != ctx.root_rank:  # root_rank is global, as hvd.rank()
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: object = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor (``tensor`` is unchanged)."""
    resolve(process_set, "broadcast")
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, process_set: Any) -> Any:
        world = resolve(process_set, "alltoall").size
        sent = send_splits(tensor.shape[0], splits, world) if tensor.dim() else splits
        out, received = synchronize(alltoall_async(tensor, sent, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out if splits is None else (out, received)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: object = None,
    name: str | None = None,
    process_set: object = global_process_set,
) -> Any:
    """Rank ``j`` gets ``splits[j]`` rows of this rank's ``tensor`` (equal parts by default).

    Returns the received rows in rank order, and with ``splits`` given also how
    many rows came from each rank, as Horovod.
    """
    resolve(process_set, "alltoall")
    return _Alltoall.apply(tensor, splits, name, process_set)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: Any, op: Any, pre: Any, post: Any, process_set: Any
    ) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        world = resolve(ctx.process_set, "reducescatter").size
        factor = ctx.pre * ctx.post * (world if ctx.op is ReduceOp.Sum else 1)
        gathered = allgather(grad * factor if factor != 1 else grad, process_set=ctx.process_set)
        return gathered, None, None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: object = ReduceOp.Average,
    process_set: object = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """``tensor`` reduced over every process, dim 0 split among ranks (first ranks get more)."""
    resolve(process_set, "reducescatter")
    rop = resolve_op(op, None)
    compressed, cctx = compression.compress(tensor)
    part = _Reducescatter.apply(
        compressed, name, rop, prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(part, cctx)
