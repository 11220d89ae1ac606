"""Grouped allgather and reducescatter: a list of tensors in one call and one handle.

Horovod fuses the tensors of a grouped call into one operation that completes
as a whole. Here each tensor goes through the single-tensor operation (its
own checks, uneven first dimensions for allgather, Horovod's split of dim 0
for reducescatter) and all of their works are started before any is waited
for, under one handle: ``synchronize`` returns the list, ``poll`` is true
once every part is done. The out-of-place forms are differentiable, with
Horovod's gradients: grouped allgather averages the incoming gradients over
the set and keeps this rank's rows; grouped reducescatter all-gathers them
(times the set's size for ``Sum``, times the scale factors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from manygpu.errors import UsageError
from manygpu.horovod import pending
from manygpu.horovod.compression import Compression, Compressor
from manygpu.horovod.data_ops import allgather_async
from manygpu.horovod.differentiable import grouped_allreduce
from manygpu.horovod.handles import synchronize
from manygpu.horovod.matching import release
from manygpu.horovod.process_sets import global_process_set, resolve
from manygpu.horovod.reduce_ops import ReduceOp, reducescatter_async, resolve_op


def _tensors(tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    out = list(tensors)
    if not out or not all(isinstance(t, torch.Tensor) for t in out):
        raise UsageError(f"{what} needs a non-empty list of tensors")
    return out


def _part_name(name: str | None, i: int) -> str | None:
    return None if name is None else f"{name}.{i}"


def _one_handle(start: Callable[[int], int], count: int, what: str, scope: Any) -> int:
    """Start ``count`` operations (``start(i)`` gives a handle) and merge them into one.

    The merged handle holds no works of its own: a named part may start later (once
    every rank has made it), so ``poll`` asks the parts, and ``synchronize`` waits for
    each part, freeing every part's name even when one fails (a timeout).
    """
    handles = [start(i) for i in range(count)]
    first = pending.get(handles[0])
    seq = first.seq if first is not None else 0

    def finish() -> list[torch.Tensor]:
        try:
            return [synchronize(h) for h in handles]
        finally:
            for h in handles:  # the parts not reached when one raised
                part = pending.take(h)
                if part is not None:  # it will never be synchronized: its name is free
                    release(part.name)

    return pending.submit([], finish, f"{what}({count} tensors)", seq, scope, parts=handles)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: object = global_process_set,
) -> int:
    """Start allgathering each of ``tensors`` (dim 0 may differ per rank); one handle
    whose ``synchronize`` gives the list of results. The inputs are not modified."""
    scope = resolve(process_set, "grouped_allgather")
    items = _tensors(tensors, "grouped_allgather")

    def start(i: int) -> int:
        return allgather_async(items[i], _part_name(name, i), process_set)

    return _one_handle(start, len(items), "grouped_allgather", scope)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: object = ReduceOp.Average,
    process_set: object = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing each of ``tensors`` and scattering its dim 0 over the set's ranks;
    one handle whose ``synchronize`` gives this rank's parts. The inputs are not modified."""
    scope = resolve(process_set, "grouped_reducescatter")
    rop = resolve_op(op, None)
    items = _tensors(tensors, "grouped_reducescatter")
    if any(t.dim() == 0 for t in items):
        raise UsageError("grouped_reducescatter needs tensors with at least one dimension")

    def start(i: int) -> int:
        return reducescatter_async(
            items[i], _part_name(name, i), rop, process_set, prescale_factor, postscale_factor
        )

    return _one_handle(start, len(items), "grouped_reducescatter", scope)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, process_set: Any, *tensors: torch.Tensor) -> Any:
        ctx.process_set = process_set
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        reduced = grouped_allreduce(list(grads), op=ReduceOp.Average, process_set=ctx.process_set)
        mine = torch.tensor([ctx.rows], dtype=torch.int64)
        table = grouped_allgather([mine], process_set=ctx.process_set)[0]  # set size x tensors
        before = table[: resolve(ctx.process_set, "grouped_allgather").rank].sum(0).tolist()
        parts = [
            g.narrow(0, int(start), rows)
            for g, start, rows in zip(reduced, before, ctx.rows, strict=True)
        ]
        return (None, None, *parts)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: object = global_process_set,
) -> list[torch.Tensor]:
    """Each of ``tensors`` concatenated along dim 0 over the set's ranks, in rank order."""
    resolve(process_set, "grouped_allgather")
    items = _tensors(tensors, "grouped_allgather")
    return list(_GroupedAllgather.apply(name, process_set, *items))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: Any, op: Any, process_set: Any, pre: Any, post: Any, *tensors: torch.Tensor
    ) -> Any:
        ctx.op, ctx.process_set, ctx.pre, ctx.post = op, process_set, pre, post
        handle = grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        world = resolve(ctx.process_set, "grouped_reducescatter").size
        factor = ctx.pre * ctx.post * (world if ctx.op is ReduceOp.Sum else 1)
        scaled = [g * factor if factor != 1 else g for g in grads]
        return (
            None,
            None,
            None,
            None,
            None,
            *grouped_allgather(scaled, process_set=ctx.process_set),
        )


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: object = ReduceOp.Average,
    process_set: object = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced over the set, dim 0 split among its ranks (first get more)."""
    resolve(process_set, "grouped_reducescatter")
    rop = resolve_op(op, None)
    packed = [compression.compress(t) for t in _tensors(tensors, "grouped_reducescatter")]
    parts = _GroupedReducescatter.apply(
        name, rop, process_set, prescale_factor, postscale_factor, *[c for c, _ in packed]
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(parts, packed, strict=True)]
