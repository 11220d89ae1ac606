"""Reductions: ``allreduce`` in its in-place and asynchronous forms, grouped, reduce-scatter.

Horovod's semantics: ``op`` defaults to ``Average`` (a sum divided by the
number of processes), ``average=True/False`` is the deprecated spelling of
``Average``/``Sum``, and ``prescale_factor`` / ``postscale_factor`` multiply
the tensor before and after the reduction (integers in float64, truncated
toward zero, as Horovod; see :func:`scale_`).
Each call is checked across ranks first (see :mod:`manygpu.horovod.checks`),
then started with ``async_op=True``; the returned handle is waited for by
``synchronize``. The differentiable out-of-place forms are in
:mod:`manygpu.horovod.differentiable`.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from manygpu.comm.common import active, reduce_scatter_single
from manygpu.errors import UsageError
from manygpu.horovod.basics import Scope
from manygpu.horovod.checks import agree
from manygpu.horovod.handles import synchronize
from manygpu.horovod.joining import zeros_spec
from manygpu.horovod.matching import claim, launch
from manygpu.horovod.missing import not_supported
from manygpu.horovod.pending import Started
from manygpu.horovod.process_sets import global_process_set, resolve
from manygpu.horovod.reports import describe
from manygpu.horovod.wire import from_wire, to_wire


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operations (same numbers as Horovod's; 2 was Adasum)."""

    Average = 0
    Sum = 1
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)
_ADASUM = 2
_DIST_OPS = {
    ReduceOp.Average: dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


def resolve_op(op: object, average: bool | None) -> ReduceOp:
    """``op``, or the deprecated ``average`` flag, as a :class:`ReduceOp` (Average by default)."""
    if op is not None and average is not None:
        raise UsageError("give op= or the deprecated average=, not both (op supersedes average)")
    if average is not None:
        warnings.warn(
            "average= is deprecated in Horovod's API; use op=hvd.Average or op=hvd.Sum",
            DeprecationWarning,
            stacklevel=3,
        )
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    if op == _ADASUM:
        not_supported("Adasum")
    try:
        return ReduceOp(op)  # type: ignore[arg-type]
    except ValueError:
        names = ", ".join(f"hvd.{o.name}" for o in ReduceOp)
        raise UsageError(f"unknown reduce op {op!r}; choose one of {names}") from None


def scale_(tensor: torch.Tensor, factor: float, what: str) -> None:
    """Multiply in place by a pre/postscale factor, as Horovod does.

    Floating-point tensors are multiplied in their own dtype (float16 in
    float32 arithmetic on CPU). Integer tensors are multiplied in float64 and
    truncated toward zero on the way back, as Horovod's C++ cast does:
    ``int32([-7, 7]) * 0.5`` is ``[-3, 3]``.
    """
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
        return
    if tensor.dtype == torch.bool:
        raise UsageError(f"{what}={factor} needs a numeric tensor, not torch.bool")
    tensor.copy_(tensor.to(torch.float64).mul_(factor).trunc_())


def check_scales(tensors: Sequence[torch.Tensor], prescale: float, postscale: float) -> None:
    """Refuse, before any rank meets another, the scale factors :func:`scale_` would
    refuse after the cross-rank check: ranks in ``hvd.join()`` are told to stand in
    by then, and would wait for a collective the callers never start."""
    for what, factor in (("prescale_factor", prescale), ("postscale_factor", postscale)):
        if factor != 1.0 and any(t.dtype == torch.bool for t in tensors):
            raise UsageError(f"{what}={factor} needs a numeric tensor, not torch.bool")


def finish_(tensor: torch.Tensor, op: ReduceOp, postscale: float, world: int) -> torch.Tensor:
    """After the sum: the postscale, and Average's division by ``world``, as Horovod.

    One multiplication (integers in float64, truncated), so an integer average
    is truncated toward zero: ``(-3 + 0) / 2`` is ``-1``. A floating-point average
    is divided by ``world`` after the postscale, as Horovod's torch binding does:
    ``x * (1/3)`` and ``x / 3`` differ in the last bit, and Horovod's join test
    compares exactly.
    """
    if op is ReduceOp.Average and (tensor.is_floating_point() or tensor.is_complex()):
        scale_(tensor, postscale, "postscale_factor")
        return tensor.div_(world)
    factor = postscale / world if op is ReduceOp.Average else postscale
    scale_(tensor, factor, "postscale_factor")
    return tensor


def _contiguous(tensor: torch.Tensor, what: str) -> None:
    if not tensor.is_contiguous():
        raise UsageError(f"{what} needs a contiguous tensor; pass tensor.contiguous()")


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> int:
    """Start reducing ``tensor`` in place over every process (of the set); a handle for
    ``synchronize``."""
    scope = resolve(process_set, "allreduce")
    rop = resolve_op(op, average)
    _contiguous(tensor, "allreduce_")
    check_scales([tensor], prescale_factor, postscale_factor)
    named = claim("allreduce", name)
    desc = describe("allreduce", tensor, name, op=rop.name)
    key = ("allreduce", name, int(rop), prescale_factor, postscale_factor)

    def start() -> Started:
        seq = agree(
            "all_reduce", tensor, key=key, desc=desc, name=name, scope=scope,
            shadow=lambda: zeros_spec([tensor], _DIST_OPS[rop]),  # what joined ranks send
        )  # fmt: skip
        data = tensor.detach()  # same storage; a leaf that requires grad is written through it
        wired = to_wire(data, "allreduce", reduce=True)  # `data` unless its dtype is carried
        scale_(wired, prescale_factor, "prescale_factor")
        work = None
        if active():
            work = dist.all_reduce(wired, op=_DIST_OPS[rop], group=scope.group, async_op=True)

        def finish() -> torch.Tensor:
            finish_(wired, rop, postscale_factor, scope.size)
            if wired is not data:
                data.copy_(from_wire(wired, data.dtype))
            return tensor

        return [work], finish, seq

    return launch(start, desc, scope, named)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> int:
    """Start reducing a copy of ``tensor`` (left unchanged); ``synchronize`` returns the copy."""
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(out, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` in place over every process and return it."""
    handle = allreduce_async_(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return synchronize(handle)


def _flat_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), in order: one collective each."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> int:
    """Start reducing a list of tensors in place, as one flat collective per dtype."""
    scope = resolve(process_set, "grouped_allreduce")
    rop = resolve_op(op, average)
    tensors = list(tensors)
    if not tensors:
        raise UsageError("grouped_allreduce needs a non-empty list of tensors")
    check_scales(tensors, prescale_factor, postscale_factor)
    named = claim("grouped_allreduce", name)
    shapes = [(tuple(t.shape), str(t.dtype)) for t in tensors]
    desc = describe("grouped_allreduce", None, name, tensors=len(tensors), op=rop.name)
    key = ("grouped_allreduce", name, int(rop), prescale_factor, postscale_factor, shapes)
    details = [(f"#{i}", shape, dtype) for i, (shape, dtype) in enumerate(shapes)]

    def start() -> Started:
        seq = agree(
            "all_reduce", None, key=key, desc=desc, details=details, name=name, scope=scope,
            shadow=lambda: zeros_spec(tensors, _DIST_OPS[rop]),  # what joined ranks send
        )  # fmt: skip
        works: list[dist.Work | None] = []
        flats = []
        for group in _flat_groups(tensors):
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in group])
            flat = to_wire(flat, "grouped_allreduce", reduce=True)
            scale_(flat, prescale_factor, "prescale_factor")
            if active():
                works.append(
                    dist.all_reduce(flat, op=_DIST_OPS[rop], group=scope.group, async_op=True)
                )
            flats.append((group, flat))

        def finish() -> list[torch.Tensor]:
            for group, flat in flats:
                finish_(flat, rop, postscale_factor, scope.size)
                _unflatten(flat, [tensors[i] for i in group])
            return tensors

        return works, finish, seq

    return launch(start, desc, scope, named)


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        with torch.no_grad():
            t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> int:
    """Start reducing copies of ``tensors`` (left unchanged); ``synchronize`` returns the copies."""
    outs = [t.detach().clone() for t in tensors]
    return grouped_allreduce_async_(
        outs, average, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place; returns the list."""
    handle = grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return synchronize(handle)


def scatter_counts(rows: int, world: int) -> list[int]:
    """Rows of dim 0 each rank gets: Horovod gives the first ``rows % world`` ranks one more."""
    return [rows // world + (1 if r < rows % world else 0) for r in range(world)]


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: object = ReduceOp.Average,
    process_set: object = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` and scattering dim 0; ``synchronize`` returns this rank's part."""
    scope = resolve(process_set, "reducescatter")
    rop = resolve_op(op, None)
    if tensor.dim() == 0:
        raise UsageError("reducescatter needs a tensor with at least one dimension")
    check_scales([tensor], prescale_factor, postscale_factor)
    named = claim("reducescatter", name)
    desc = describe("reducescatter", tensor, name, op=rop.name)
    key = ("reducescatter", name, int(rop), prescale_factor, postscale_factor)

    def start() -> Started:
        seq = agree("reduce_scatter", tensor, key=key, desc=desc, name=name, scope=scope)
        return _start_reducescatter(tensor, rop, scope, prescale_factor, postscale_factor, seq)

    return launch(start, desc, scope, named)


def _start_reducescatter(
    tensor: torch.Tensor,
    rop: ReduceOp,
    scope: Scope,
    prescale_factor: float,
    postscale_factor: float,
    seq: int,
) -> Started:
    """Pad each rank's rows to equal slices and start the reduce-scatter."""
    world, me = scope.size, scope.rank
    counts = scatter_counts(tensor.shape[0], world)
    longest, rest = counts[0], tuple(tensor.shape[1:])
    # Equal slices of `longest` rows each; rank r's real rows first, zeros after.
    padded = tensor.new_zeros((world * longest, *rest))
    offset = 0
    for r, n in enumerate(counts):
        padded[r * longest : r * longest + n] = tensor[offset : offset + n].detach()
        offset += n
    padded = to_wire(padded, "reducescatter", reduce=True)
    scale_(padded, prescale_factor, "prescale_factor")
    out = padded.new_empty((longest, *rest))
    work = None
    if active():
        work = reduce_scatter_single(
            out, padded, op=_DIST_OPS[rop], group=scope.group, async_op=True
        )
    else:
        out.copy_(padded)

    def finish() -> torch.Tensor:
        return from_wire(finish_(out[: counts[me]], rop, postscale_factor, world), tensor.dtype)

    return [work], finish, seq
