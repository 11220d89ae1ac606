"""Moving data: allgather (uneven first dimensions), broadcast, alltoall, barrier.

Horovod lets ranks' tensors differ in their first dimension for ``allgather``
and ``alltoall``; the sizes are exchanged first (a tiny collective), then the
data moves in one asynchronous collective (padded to the longest for
allgather, with per-rank splits for alltoall). The differentiable
out-of-place forms are in :mod:`manygpu.horovod.differentiable`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from manygpu.comm import debug as dbg
from manygpu.comm.collectives import barrier as comm_barrier
from manygpu.comm.common import active, all_gather_single, scratch_device, wait
from manygpu.errors import CollectiveTimeoutError, UsageError
from manygpu.horovod.basics import Scope, session
from manygpu.horovod.checks import agree
from manygpu.horovod.exceptions import internal
from manygpu.horovod.handles import synchronize
from manygpu.horovod.joining import BARRIER
from manygpu.horovod.matching import claim, launch
from manygpu.horovod.pending import Pending, Started, wait_pending
from manygpu.horovod.process_sets import global_process_set, resolve
from manygpu.horovod.reports import describe
from manygpu.horovod.wire import from_wire, to_wire


def _wait(work: dist.Work | None, what: str) -> None:
    """Wait for a small exchange of sizes; a failure is an ``hvd.HorovodInternalError`` too."""
    try:
        wait(work, what, session().timeout_s)
    except CollectiveTimeoutError as exc:
        raise internal(exc) from exc


def _gather_sizes(rows: int, device: torch.device, what: str, scope: Scope) -> list[int]:
    """Every rank's first dimension (a small synchronous all-gather over the set)."""
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    table = mine.new_empty(scope.size)
    work = all_gather_single(table, mine, group=scope.group, async_op=True)
    _wait(work, f"{what} sizes")
    return [int(n) for n in table.tolist()]


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: object = global_process_set
) -> int:
    """Start concatenating every rank's ``tensor`` along dim 0 (dim 0 may differ per rank)."""
    scope = resolve(process_set, "allgather")
    named = claim("allgather", name)
    local = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach().contiguous()
    desc = describe("allgather", local, name)
    shape = (dbg.ANY, *local.shape[1:])

    def start() -> Started:
        seq = agree(
            "all_gather_uneven", local, key=("allgather", name), desc=desc, shape=shape,
            name=name, scope=scope,
        )  # fmt: skip
        if not active():
            return [], local.clone, seq
        return _start_allgather(local, desc, scope, seq)

    return launch(start, desc, scope, named)


def _start_allgather(local: torch.Tensor, desc: str, scope: Scope, seq: int) -> Started:
    """Pad every rank's rows to the longest and start the all-gather."""
    world, rest = scope.size, tuple(local.shape[1:])
    wired = to_wire(local, "allgather")  # after agree: every rank refuses alike
    sizes = _gather_sizes(local.shape[0], local.device, desc, scope)
    longest = max(sizes)
    padded = wired.new_zeros((longest, *rest))
    padded[: local.shape[0]] = wired
    table = wired.new_empty((world * longest, *rest))
    work = all_gather_single(table, padded, group=scope.group, async_op=True)

    def finish() -> torch.Tensor:
        rows = table.view(world, longest, *rest)
        return from_wire(torch.cat([rows[r, :n] for r, n in enumerate(sizes)]), local.dtype)

    return [work], finish, seq


def check_root(root_rank: int, what: str, scope: Scope | None = None) -> None:
    """``root_rank`` must be a global rank of the job, and of the process set if one is given
    (Horovod's root is a global rank even within a set)."""
    world = session().topology.size
    if not isinstance(root_rank, int) or not 0 <= root_rank < world:
        raise UsageError(
            f"{what}: root_rank={root_rank!r} is not a rank of this job (0..{world - 1})"
        )
    if scope is not None and root_rank not in scope.ranks:
        raise UsageError(
            f"{what}: root_rank={root_rank} is not in the process set (global ranks "
            f"{list(scope.ranks)}); root_rank is a global rank, as hvd.rank() gives"
        )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: object = global_process_set,
) -> int:
    """Start copying ``root_rank``'s ``tensor`` into every rank's ``tensor`` (in place).

    ``root_rank`` is a global rank, also within a process set (as in Horovod).
    """
    scope = resolve(process_set, "broadcast")
    check_root(root_rank, "broadcast", scope)
    if not tensor.is_contiguous():
        raise UsageError("broadcast_ needs a contiguous tensor; pass tensor.contiguous()")
    named = claim("broadcast", name)
    desc = describe("broadcast", tensor, name, root_rank=root_rank)
    key = ("broadcast", name, root_rank)

    def start() -> Started:
        seq = agree("broadcast", tensor, key=key, desc=desc, name=name, scope=scope)
        data = tensor.detach()  # a leaf that requires grad can still be written through its data
        wired = to_wire(data, "broadcast")  # `data` itself unless its dtype must be carried
        work = None
        if active():
            work = dist.broadcast(wired, src=root_rank, group=scope.group, async_op=True)

        def finish() -> torch.Tensor:
            if wired.data_ptr() != data.data_ptr():
                data.copy_(from_wire(wired, data.dtype))
            return tensor

        return [work], finish, seq

    return launch(start, desc, scope, named)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: object = global_process_set,
) -> int:
    """Start broadcasting into a copy of ``tensor`` (left unchanged)."""
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_async_(out, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: object = global_process_set,
) -> torch.Tensor:
    """Copy ``root_rank``'s ``tensor`` into every rank's ``tensor`` and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def send_splits(rows: int, splits: Any, world: int) -> list[int]:
    """Rows sent to each rank: ``splits`` checked, or dim 0 cut in ``world`` equal parts."""
    if splits is None:
        if rows % world:
            raise UsageError(
                f"alltoall without splits needs dim 0 ({rows}) divisible by the number "
                f"of processes ({world}); pass splits= (rows for each rank)"
            )
        return [rows // world] * world
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    out = [int(v) for v in values]
    if len(out) != world or any(v < 0 for v in out) or sum(out) != rows:
        raise UsageError(
            f"alltoall splits={out} must have {world} non-negative entries summing to "
            f"dim 0 of the tensor ({rows})"
        )
    return out


def alltoall_async(
    tensor: torch.Tensor,
    splits: object = None,
    name: str | None = None,
    process_set: object = global_process_set,
) -> int:
    """Start sending ``splits[j]`` rows to rank ``j`` and receiving each rank's rows for us.

    ``synchronize`` returns the received tensor, and with ``splits`` given also
    the rows received from each rank (an int32 tensor), as Horovod.
    """
    scope = resolve(process_set, "alltoall")
    if tensor.dim() == 0:
        raise UsageError("alltoall needs a tensor with at least one dimension")
    sent = send_splits(tensor.shape[0], splits, scope.size)
    named = claim("alltoall", name)
    desc = describe("alltoall", tensor, name)
    shape = (dbg.ANY, *tensor.shape[1:])

    def start() -> Started:
        seq = agree(
            "all_to_all", tensor, key=("alltoall", name), desc=desc, shape=shape, name=name,
            scope=scope,
        )  # fmt: skip
        return _start_alltoall(tensor, splits, sent, desc, scope, seq)

    return launch(start, desc, scope, named)


def _start_alltoall(
    tensor: torch.Tensor, splits: object, sent: list[int], desc: str, scope: Scope, seq: int
) -> Started:
    """Exchange the row counts, then start sending each rank its rows."""
    data = to_wire(tensor.detach().contiguous(), "alltoall")
    if active():
        mine = torch.tensor(sent, dtype=torch.int64, device=data.device)
        theirs = torch.empty_like(mine)
        work = dist.all_to_all_single(theirs, mine, group=scope.group, async_op=True)
        _wait(work, f"{desc} splits")
        received = [int(n) for n in theirs.tolist()]
        out = data.new_empty((sum(received), *data.shape[1:]))
        work = dist.all_to_all_single(out, data, received, sent, group=scope.group, async_op=True)
    else:
        received, out, work = sent, data.clone(), None
    received_t = (
        splits.new_tensor(received)
        if isinstance(splits, torch.Tensor)
        else torch.tensor(received, dtype=torch.int32)
    )

    def finish() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        result = from_wire(out, tensor.dtype)
        return result if splits is None else (result, received_t)

    return [work], finish, seq


def barrier(process_set: object = global_process_set) -> None:
    """Wait until every process (of the set) gets here (a stall names the missing ranks)."""
    scope = resolve(process_set, "barrier")
    seq = agree(
        "barrier", None, key=("barrier",), desc="barrier()", scope=scope, shadow=lambda: BARRIER
    )
    if not active():
        return
    if scope.whole:
        comm_barrier(timeout_s=session().timeout_s, debug=False)
        return
    # A set's barrier: a one-element all-reduce over its sub-group, waited like the others.
    flag = torch.zeros(1, device=scratch_device())
    work = dist.all_reduce(flag, group=scope.group, async_op=True)
    wait_pending(
        Pending(works=[work], finish=lambda: None, description="barrier()", seq=seq, scope=scope)
    )
