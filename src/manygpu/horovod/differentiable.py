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

from manygpu.horovod.basics import check_process_set, global_process_set, session
from manygpu.horovod.compression import Compression, Compressor
from manygpu.horovod.data_ops import allgather_async, alltoall_async, broadcast_async, send_splits
from manygpu.horovod.handles import synchronize
from manygpu.horovod.reduce_ops import (
    ReduceOp,
    allreduce_async,
    grouped_allreduce_async,
    reducescatter_async,
    resolve_op,
)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, op: Any, pre: Any, post: Any) -> Any:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return synchronize(allreduce_async(tensor, None, name, op, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post)
        return reduced, None, None, None, None


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
    check_process_set(process_set)
    rop = resolve_op(op, average)
    compressed, cctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, rop, prescale_factor, postscale_factor)
    return compression.decompress(reduced, cctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, op: Any, pre: Any, post: Any, *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        reduced = grouped_allreduce(
            list(grads), op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post
        )
        return (None, None, None, None, *reduced)


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
    check_process_set(process_set)
    rop = resolve_op(op, average)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(
        name, rop, prescale_factor, postscale_factor, *[c for c, _ in packed]
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, packed, strict=True)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any) -> Any:
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=ReduceOp.Average)
        rows = allgather(torch.tensor([ctx.rows], device=grad.device)).tolist()
        offset = sum(rows[: session().topology.rank])
        return reduced.narrow(0, offset, ctx.rows), None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: object = global_process_set
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (dim 0 may differ)."""
    check_process_set(process_set)
    return _Allgather.apply(tensor, name)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: Any, name: Any) -> Any:
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=ReduceOp.Average)
        if session().topology.rank != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: object = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor (``tensor`` is unchanged)."""
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any) -> Any:
        world = session().topology.size
        sent = send_splits(tensor.shape[0], splits, world) if tensor.dim() else splits
        out, received = synchronize(alltoall_async(tensor, sent, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out if splits is None else (out, received)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        back, _ = alltoall(grad, splits=ctx.received)
        return back, None, None


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
    check_process_set(process_set)
    return _Alltoall.apply(tensor, splits, name)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, op: Any, pre: Any, post: Any) -> Any:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return synchronize(reducescatter_async(tensor, name, op, None, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        factor = ctx.pre * ctx.post * (session().topology.size if ctx.op is ReduceOp.Sum else 1)
        return allgather(grad * factor if factor != 1 else grad), None, None, None, None


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
    check_process_set(process_set)
    rop = resolve_op(op, None)
    compressed, cctx = compression.compress(tensor)
    part = _Reducescatter.apply(compressed, name, rop, prescale_factor, postscale_factor)
    return compression.decompress(part, cctx)
