"""Collectives of Python objects: JSON for manygpu's own metadata, pickle only when asked.

:func:`all_gather_json` and :func:`broadcast_json` carry what manygpu itself
exchanges (descriptions of calls, layouts, call sites, checkpoint file tables
and decisions, a pipeline's output shape, the doctor's facts), over the default
group or a ``group=`` of their own: the object travels as UTF-8 JSON in a
``uint8`` tensor, the lengths first, and is read back with ``json.loads``. A
payload that is not JSON, or longer than the limit, is a :class:`PayloadError`
naming the rank that sent it; nothing it holds is ever executed. Callers still
check the structure of what they receive (:func:`parse_each`).

:func:`broadcast_object` and :func:`all_gather_object` are torch's object
collectives, which pickle: whatever a rank sends is unpickled by the others,
so a job member (or anything that can inject bytes into the job's traffic)
can run code in every receiving rank. Use them only between the ranks of your
own job, for your own objects. torch gives them no per-call timeout; the
process group's timeout (``Parallel(timeout_s=...)``) bounds them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from manygpu.comm.common import (
    DEFAULT_TIMEOUT_S,
    active,
    all_gather_single,
    first_line,
    scratch_device,
    wait,
)
from manygpu.errors import CollectiveTimeoutError, ManyGPUError

T = TypeVar("T")

JSON_LIMIT = 64 * 2**20
"""Largest JSON payload accepted from one rank (bytes): a lie about a length cannot
make the others allocate without bound."""


class PayloadError(ManyGPUError, ValueError):
    """Another rank sent metadata that is not what manygpu sends (not JSON, too long,
    or the wrong structure): a bug, a version mismatch between ranks, or a stranger."""

    def __init__(self, rank: int, operation: str, sender: int, detail: str) -> None:
        self.sender = sender
        super().__init__(
            f"rank {rank}: {operation}: rank {sender} sent a malformed payload ({detail}); "
            "every rank must run the same manygpu version, and only the job's ranks may "
            "reach its network"
        )


def _guard(operation: str, exc: RuntimeError) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(dist.get_rank(), operation, None, first_line(exc))


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(data: bytes, *, sender: int, operation: str) -> Any:
    """``data`` read as JSON; a :class:`PayloadError` naming ``sender`` when it is not."""
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        me = dist.get_rank() if dist.is_initialized() else 0
        raise PayloadError(me, operation, sender, first_line(exc)) from None


def _alone(group: dist.ProcessGroup | None) -> bool:
    """Whether there is nobody to exchange with (no group, or a group of one)."""
    if group is None:
        return not active()
    return dist.get_world_size(group) <= 1


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the payload tensors must live for ``group``'s backend (a gloo side group
    of an NCCL job takes CPU tensors)."""
    if group is None:
        return scratch_device()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parse_each(
    sent: list[Any], parse: Callable[[Any], T], *, operation: str, first_sender: int = 0
) -> list[T]:
    """``parse`` of each rank's decoded payload, in order (the first sent by rank
    ``first_sender``, the next by the rank after it...).

    ``parse`` checks the structure and raises ``TypeError``, ``ValueError``,
    ``KeyError`` or ``AttributeError`` when it is not what manygpu sends: that
    becomes a :class:`PayloadError` naming the sender.
    """
    out = []
    for sender, value in enumerate(sent, start=first_sender):
        try:
            out.append(parse(value))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            me = dist.get_rank() if dist.is_initialized() else 0
            raise PayloadError(me, operation, sender, first_line(exc)) from None
    return out


def _check_length(n: int, *, sender: int, operation: str, limit: int) -> None:
    if not 0 <= n <= limit:
        detail = f"a length of {n} bytes, outside 0..{limit}"
        raise PayloadError(dist.get_rank(), operation, sender, detail)


def all_gather_json(
    obj: Any,
    *,
    operation: str = "all_gather_json",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    limit: int = JSON_LIMIT,
    group: dist.ProcessGroup | None = None,
) -> list[Any]:
    """Every rank's JSON-serialisable ``obj``, decoded, in rank order (tuples come back as lists).

    Two all-gathers: the lengths, then the bytes padded to the longest.
    ``operation`` names the call in errors. Over ``group`` (default: the
    default group), in its rank order; errors name the sender's global rank.
    """
    if _alone(group):
        return [json.loads(_encode(obj))]
    data = _encode(obj)
    device = _device(group)
    world = dist.get_world_size(group)
    senders = [r if group is None else dist.get_global_rank(group, r) for r in range(world)]
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = mine.new_empty(world)
    work = all_gather_single(sizes, mine, group=group, async_op=True)
    wait(work, f"{operation} sizes", timeout_s)
    lengths = [int(n) for n in sizes.tolist()]
    for sender, n in zip(senders, lengths, strict=True):
        _check_length(n, sender=sender, operation=operation, limit=limit)
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    table = torch.empty(world * longest, dtype=torch.uint8, device=device)
    work = all_gather_single(table, padded.to(device), group=group, async_op=True)
    wait(work, operation, timeout_s)
    rows = table.cpu().view(world, longest)
    return [
        decode_json(rows[r, :n].numpy().tobytes(), sender=sender, operation=operation)
        for r, (sender, n) in enumerate(zip(senders, lengths, strict=True))
    ]


def broadcast_json(
    obj: Any,
    src: int = 0,
    *,
    operation: str = "broadcast_json",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    limit: int = JSON_LIMIT,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """``src``'s JSON-serialisable ``obj`` on every rank, decoded (``src`` gets it decoded too).

    Over ``group`` (default: the default group); ``src`` is a global rank, as in
    ``torch.distributed.broadcast``.
    """
    if _alone(group):
        return json.loads(_encode(obj))
    device = _device(group)
    data = _encode(obj) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    work = dist.broadcast(size, src=src, group=group, async_op=True)
    wait(work, f"{operation} size", timeout_s)
    n = int(size.item())
    _check_length(n, sender=src, operation=operation, limit=limit)
    buf = torch.zeros(n, dtype=torch.uint8)
    if data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    wait(dist.broadcast(buf, src=src, group=group, async_op=True), operation, timeout_s)
    return decode_json(buf.cpu().numpy().tobytes(), sender=src, operation=operation)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``src``'s ``obj`` on every rank (pickled: trusts every rank of the job, see above)."""
    if not active():
        return obj
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=src)
    except RuntimeError as exc:
        raise _guard(f"broadcast_object[src={src}]", exc) from exc
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled: trusts every rank of the job, see above)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as exc:
        raise _guard("all_gather_object", exc) from exc
    return out
