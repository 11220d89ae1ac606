"""What every collective wrapper shares: is a group up, waiting with a timeout, names."""

from __future__ import annotations

import datetime as dt

import torch
import torch.distributed as dist

from manygpu.errors import CollectiveTimeoutError, UsageError
from manygpu.runtime import env as envmod

DEFAULT_TIMEOUT_S = envmod.DEFAULT_TIMEOUT_S

# torch 2.13 renamed the tensor forms; older releases (>= 2.6) have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def active() -> bool:
    """Whether a default group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def require_tensor(operation: str, value: object) -> None:
    """Refuse anything but a ``torch.Tensor``, whatever the world size.

    With one process the collectives hand their argument straight back, so a
    list or a number passed there would pass unnoticed and fail only once the
    job runs on several ranks; refusing it on every world size makes the
    one-process run catch it.
    """
    if not isinstance(value, torch.Tensor):
        raise UsageError(
            f"manygpu.comm.{operation} needs a torch.Tensor, not {type(value).__name__}; "
            "wrap the values first, e.g. torch.tensor(values)"
        )


def debug_requested(debug: bool | None) -> bool:
    """An explicit ``debug=`` wins; ``None`` reads ``MANYGPU_DEBUG``."""
    return envmod.debug_enabled(envmod.current()) if debug is None else debug


def describe(name: str, tensor: torch.Tensor) -> str:
    """``all_reduce[sum](float32[4x8])``: how errors name an operation."""
    shape = "x".join(str(s) for s in tensor.shape) or "scalar"
    return f"{name}({str(tensor.dtype).removeprefix('torch.')}[{shape}])"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# Backend messages that mean "a peer never answered" rather than a bug in the model.
_PEER_FAILURE_HINTS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
)


def raise_peer_failure(
    exc: RuntimeError, *, rank: int, world_size: int, operation: str, timeout_s: float
) -> None:
    """Raise ``exc`` (raised inside ``operation``) as the collective timeout it means when a
    peer never answered; return when it is something else (a bug of the model's: the
    caller re-raises it as it is)."""
    if isinstance(exc, CollectiveTimeoutError):  # named already: keep the backend's words
        raise exc
    text = str(exc).lower()
    if world_size > 1 and any(hint in text for hint in _PEER_FAILURE_HINTS):
        raise CollectiveTimeoutError(rank, operation, timeout_s, first_line(exc)) from exc


def wait(work: dist.Work | None, operation: str, timeout_s: float) -> None:
    """Wait for ``work``; a backend timeout or peer failure becomes a named error."""
    if work is None:
        return
    try:
        work.wait(dt.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CollectiveTimeoutError(
            dist.get_rank(), operation, timeout_s, first_line(exc)
        ) from exc


def scratch_device() -> torch.device:
    """Where small bookkeeping tensors must live for the default backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
