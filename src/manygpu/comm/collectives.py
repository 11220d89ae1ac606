"""Typed collectives over the default group, each bounded by a timeout.

torch's collectives wait for the group's timeout and then fail with a backend
message that rarely says which operation was stuck. These wrappers wait on the
async work with an explicit timeout and raise
:class:`~manygpu.errors.CollectiveTimeoutError` naming rank and operation.
When no group exists (one process), they return the local answer.
"""

from __future__ import annotations

import datetime as dt
from typing import Literal

import torch
import torch.distributed as dist

from manygpu.errors import CollectiveTimeoutError

ReduceOp = Literal["sum", "mean", "max", "min"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _describe(name: str, tensor: torch.Tensor) -> str:
    shape = "x".join(str(s) for s in tensor.shape) or "scalar"
    return f"{name}({str(tensor.dtype).removeprefix('torch.')}[{shape}])"


def _wait(work: dist.Work | None, operation: str, timeout_s: float) -> None:
    """Wait for ``work``; turn a backend timeout into a named error."""
    if work is None:
        return
    try:
        work.wait(dt.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CollectiveTimeoutError(
            dist.get_rank(), operation, timeout_s, _first_line(exc)
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def all_reduce(
    tensor: torch.Tensor, op: ReduceOp = "sum", *, timeout_s: float = 180.0
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it.

    ``"mean"`` is a sum divided by the world size (integer tensors are
    floor-divided, as torch does).
    """
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(_OPS)}")
    if not _active():
        return tensor
    work = dist.all_reduce(tensor, op=_OPS[op], async_op=True)
    _wait(work, _describe(f"all_reduce[{op}]", tensor), timeout_s)
    if op == "mean":
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(dist.get_world_size())
        else:
            tensor.floor_divide_(dist.get_world_size())
    return tensor


def all_gather(tensor: torch.Tensor, *, timeout_s: float = 180.0) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (rank order).

    Every rank must pass the same shape; 0-d tensors are gathered as a vector.
    """
    local = tensor.reshape(1) if tensor.dim() == 0 else tensor
    if not _active():
        return local.clone()
    out = torch.empty(
        (dist.get_world_size() * local.shape[0], *local.shape[1:]),
        dtype=local.dtype,
        device=local.device,
    )
    work = dist.all_gather_into_tensor(out, local.contiguous(), async_op=True)
    _wait(work, _describe("all_gather", local), timeout_s)
    return out


def broadcast(tensor: torch.Tensor, src: int = 0, *, timeout_s: float = 180.0) -> torch.Tensor:
    """Copy ``src``'s ``tensor`` into every rank's ``tensor`` and return it."""
    if not _active():
        return tensor
    work = dist.broadcast(tensor, src=src, async_op=True)
    _wait(work, _describe(f"broadcast[src={src}]", tensor), timeout_s)
    return tensor


def barrier(*, timeout_s: float = 180.0) -> None:
    """Wait for every rank.

    On gloo this is ``monitored_barrier``, whose error names the ranks that did
    not arrive; on other backends an all-reduce of one element with a timeout.
    """
    if not _active():
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=dt.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise CollectiveTimeoutError(
                dist.get_rank(), "barrier", timeout_s, _first_line(exc)
            ) from exc
        return
    flag = torch.zeros(1, device=_device_for_backend())
    work = dist.all_reduce(flag, async_op=True)
    _wait(work, "barrier", timeout_s)


def _device_for_backend() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
