"""Typed collectives over the default group, each bounded by a timeout.

torch's collectives wait for the group's timeout and then fail with a backend
message that rarely says which operation was stuck. These wrappers wait on the
async work with an explicit timeout and raise
:class:`~manygpu.errors.CollectiveTimeoutError` naming rank and operation.
With ``debug=True`` (or ``MANYGPU_DEBUG=1``) they first check that every rank
is calling the same operation on the same shape and dtype. When no group
exists (one process) they return the local answer.
"""

from __future__ import annotations

import datetime as dt
from typing import Literal

import torch
import torch.distributed as dist

from manygpu.comm import debug as dbg
from manygpu.comm.common import (
    DEFAULT_TIMEOUT_S,
    active,
    all_gather_single,
    debug_requested,
    describe,
    first_line,
    reduce_scatter_single,
    require_tensor,
    scratch_device,
    wait,
)
from manygpu.errors import CollectiveTimeoutError

ReduceOp = Literal["sum", "mean", "max", "min"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_OP_CODES = {name: i for i, name in enumerate(_OPS)}


def _check_op(op: str) -> dist.ReduceOp.RedOpType:
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(_OPS)}")
    return _OPS[op]


def _divide(tensor: torch.Tensor, by: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(by)
    else:
        tensor.floor_divide_(by)


def _maybe_check(
    debug: bool | None, op: str, tensor: torch.Tensor | None, timeout_s: float, **kwargs: object
) -> None:
    if debug_requested(debug):
        dbg.check_same_call(op, tensor, timeout_s=timeout_s, **kwargs)  # type: ignore[arg-type]


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp = "sum",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    debug: bool | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over ranks (``group``'s, else every rank) in place and return it.

    ``"mean"`` is a sum divided by the group's size (integers floor-divided).
    The debug check compares calls over every rank, so it runs for the whole
    job's reductions only.
    """
    require_tensor("all_reduce", tensor)
    reduce_op = _check_op(op)
    if not active():
        return tensor
    if group is None:
        _maybe_check(debug, "all_reduce", tensor, timeout_s, extra=_OP_CODES[op])
    work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)
    wait(work, describe(f"all_reduce[{op}]", tensor), timeout_s)
    if op == "mean":
        _divide(tensor, dist.get_world_size(group))
    return tensor


def reduce(
    tensor: torch.Tensor,
    dst: int = 0,
    op: ReduceOp = "sum",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    debug: bool | None = None,
) -> torch.Tensor:
    """Reduce into ``dst``'s ``tensor`` (others' tensors are left undefined by torch)."""
    require_tensor("reduce", tensor)
    reduce_op = _check_op(op)
    if not active():
        return tensor
    _maybe_check(debug, "reduce", tensor, timeout_s, extra=dst * 10 + _OP_CODES[op])
    work = dist.reduce(tensor, dst=dst, op=reduce_op, async_op=True)
    wait(work, describe(f"reduce[{op}, dst={dst}]", tensor), timeout_s)
    if op == "mean" and dist.get_rank() == dst:
        _divide(tensor, dist.get_world_size())
    return tensor


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    debug: bool | None = None,
) -> torch.Tensor:
    """Copy ``src``'s ``tensor`` into every rank's ``tensor`` and return it."""
    require_tensor("broadcast", tensor)
    if not active():
        return tensor
    _maybe_check(debug, "broadcast", tensor, timeout_s, extra=src)
    work = dist.broadcast(tensor, src=src, async_op=True)
    wait(work, describe(f"broadcast[src={src}]", tensor), timeout_s)
    return tensor


def all_gather(
    tensor: torch.Tensor, *, timeout_s: float = DEFAULT_TIMEOUT_S, debug: bool | None = None
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order.

    Every rank must pass the same shape (see :func:`all_gather_uneven`); a 0-d
    tensor is gathered as a vector.
    """
    require_tensor("all_gather", tensor)
    local = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    if not active():
        return local.clone()
    _maybe_check(debug, "all_gather", local, timeout_s)
    out = local.new_empty((dist.get_world_size() * local.shape[0], *local.shape[1:]))
    work = all_gather_single(out, local, async_op=True)
    wait(work, describe("all_gather", local), timeout_s)
    return out


def all_gather_uneven(
    tensor: torch.Tensor, *, timeout_s: float = DEFAULT_TIMEOUT_S, debug: bool | None = None
) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (dim 0 may differ per rank), as a list in rank order.

    Sizes are exchanged first, then each tensor is padded to the largest and
    gathered in one collective; the padding is cut off again.
    """
    require_tensor("all_gather_uneven", tensor)
    local = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    if not active():
        return [local.clone()]
    _maybe_check(debug, "all_gather_uneven", local, timeout_s, shape=(dbg.ANY, *local.shape[1:]))
    sizes = all_gather(torch.tensor([local.shape[0]], device=local.device), timeout_s=timeout_s)
    longest = int(sizes.max())
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    table = all_gather(padded, timeout_s=timeout_s).reshape(-1, longest, *local.shape[1:])
    return [table[r, : int(n)] for r, n in enumerate(sizes.tolist())]


def reduce_scatter(
    tensor: torch.Tensor,
    op: ReduceOp = "sum",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    debug: bool | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and give rank r the r-th slice of dim 0.

    ``tensor.shape[0]`` must divide by the world size.
    """
    require_tensor("reduce_scatter", tensor)
    reduce_op = _check_op(op)
    if not active():
        return tensor.clone()
    world = dist.get_world_size()
    if tensor.dim() == 0 or tensor.shape[0] % world:
        raise ValueError(
            f"reduce_scatter needs dim 0 divisible by the world size {world}, "
            f"got shape {tuple(tensor.shape)}"
        )
    _maybe_check(debug, "reduce_scatter", tensor, timeout_s, extra=_OP_CODES[op])
    out = tensor.new_empty((tensor.shape[0] // world, *tensor.shape[1:]))
    work = reduce_scatter_single(out, tensor.contiguous(), op=reduce_op, async_op=True)
    wait(work, describe(f"reduce_scatter[{op}]", tensor), timeout_s)
    if op == "mean":
        _divide(out, world)
    return out


def all_to_all(
    tensor: torch.Tensor,
    send_sizes: list[int] | None = None,
    recv_sizes: list[int] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    debug: bool | None = None,
) -> torch.Tensor:
    """Rank r sends slice j of dim 0 to rank j and receives slice r from everyone.

    Equal slices by default; ``send_sizes`` / ``recv_sizes`` give uneven ones
    (rank i's ``send_sizes[j]`` must equal rank j's ``recv_sizes[i]``).
    """
    require_tensor("all_to_all", tensor)
    if not active():
        return tensor.clone()
    _maybe_check(debug, "all_to_all", tensor, timeout_s, shape=(dbg.ANY, *tensor.shape[1:]))
    rows = sum(recv_sizes) if recv_sizes is not None else tensor.shape[0]
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    work = dist.all_to_all_single(
        out,
        tensor.contiguous(),
        output_split_sizes=recv_sizes,
        input_split_sizes=send_sizes,
        async_op=True,
    )
    wait(work, describe("all_to_all", tensor), timeout_s)
    return out


def barrier(*, timeout_s: float = DEFAULT_TIMEOUT_S, debug: bool | None = None) -> None:
    """Wait for every rank.

    On gloo this is ``monitored_barrier``, whose error names the ranks that did
    not arrive; elsewhere an all-reduce of one element with a timeout.
    """
    if not active():
        return
    _maybe_check(debug, "barrier", None, timeout_s)
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=dt.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise CollectiveTimeoutError(
                dist.get_rank(), "barrier", timeout_s, first_line(exc)
            ) from exc
        return
    flag = torch.zeros(1, device=scratch_device())
    wait(dist.all_reduce(flag, async_op=True), "barrier", timeout_s)
