"""Collectives of picklable Python objects, for small metadata inside a trusted job.

They are torch's object collectives, which pickle: use them only between the
ranks of your own job, never for data from outside it. torch gives them no
per-call timeout; the process group's timeout (``Parallel(timeout_s=...)``)
bounds them, and a failure names the rank and operation like the others.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from manygpu.comm.common import active, first_line
from manygpu.errors import CollectiveTimeoutError


def _guard(operation: str, exc: RuntimeError) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(dist.get_rank(), operation, None, first_line(exc))


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``src``'s ``obj`` on every rank (bounded by the group's timeout)."""
    if not active():
        return obj
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=src)
    except RuntimeError as exc:
        raise _guard(f"broadcast_object[src={src}]", exc) from exc
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as exc:
        raise _guard("all_gather_object", exc) from exc
    return out
