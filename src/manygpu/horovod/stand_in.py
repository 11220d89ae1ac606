"""``hvd.join()``: a rank out of data stands in for the others' collectives until all join.

What a joined rank does for each call is described in :mod:`manygpu.horovod.joining`
(the callers' side); this module is the joined rank's own loop. How it learns
what to stand in for, over torch.distributed, which matches collectives by
order: every manygpu.horovod call on the whole job starts with a round of
:mod:`manygpu.horovod.matching` (one tiny all-gather), in which a joined rank
says :attr:`Point.JOINED`. Named calls every other rank has made start then
(joined ranks are not waited for; one this rank made before joining starts as a
live call, with its real tensor), and each explicit collective begins with the
cross-rank check, where a joined rank sends a ``joined`` row and does what the
callers agreed on. A DistributedOptimizer bucket announces itself with one
asynchronous row of the round's shape (:class:`StepBeacon`, waited for in
``step()``), so a joined rank sends zeros for that bucket, in the callers'
order even when they make other calls between buckets; nobody waits for it
while no rank has joined.

``join()`` is a call of its own, like ``allreduce``: it stands above the call
path (see the package's docstring) and uses its steps, never the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from manygpu.comm import debug as dbg
from manygpu.comm.collectives import barrier as comm_barrier
from manygpu.comm.common import active, all_gather_single, scratch_device, wait
from manygpu.comm.objects import PayloadError, all_gather_json
from manygpu.errors import CollectiveTimeoutError, UsageError
from manygpu.horovod.basics import Session, session
from manygpu.horovod.joining import REDUCE_OPS, Spec, agreed, note_round, registered
from manygpu.horovod.matching import (
    Point,
    common_names,
    goes_on,
    is_deferred,
    stall_text,
    start_own,
)
from manygpu.horovod.reports import (
    HorovodMismatchError,
    calls_made,
    named_stall,
    next_call,
    render_mismatch,
)
from manygpu.runtime.ranks import ranks_text

if TYPE_CHECKING:
    from manygpu.horovod.grad_sync import GradientSync

_SITE = "join()"
_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


# -- the joined rank ------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """Stand in for the others' collectives until every rank has joined; the last to join.

    Args:
        device: the CUDA device for the zeros of CUDA all-reduces (-1: the current one).
    """
    s = session()
    if not active():
        return s.topology.rank
    rounds = 0  # rounds this rank has been joined for: the last to join has the fewest
    while True:
        quick = _round_rows(s, [int(Point.JOINED), rounds])
        if all(p == Point.JOINED for p, _ in quick):
            note_round([])  # every rank leaves join() here: nobody stands in any more
            return last_joined(quick)
        if any(p == Point.STEP for p, _ in quick):
            _stand_in_step(s, quick)
        else:
            _stand_in_round(s, device)
        rounds += 1


def last_joined(quick: Sequence[Sequence[int]]) -> int:
    """The rank joined for the fewest rounds (ties: the highest rank, as Horovod's
    coordinator, which reads requests in rank order)."""
    fewest = min(n for _, n in quick)
    return max(r for r, (_, n) in enumerate(quick) if n == fewest)


def _round_rows(s: Session, mine: list[int]) -> list[list[int]]:
    """A round's first exchange, in :mod:`manygpu.horovod.matching`'s shape: two integers."""
    row = torch.tensor(mine, dtype=torch.int64, device=scratch_device())
    table = row.new_empty(2 * s.topology.size)
    try:
        wait(all_gather_single(table, row, async_op=True), _SITE, s.timeout_s)
    except CollectiveTimeoutError as exc:
        raise named_stall(exc, calls_made(), _SITE) or exc from exc
    return [list(map(int, pair)) for pair in table.view(-1, 2).tolist()]


def _stand_in_round(s: Session, device: int) -> None:
    """The rest of a matching round: start what the others start, then their collective."""
    what = "hvd: matching named calls across ranks"
    mine: list[Any] = [int(Point.JOINED), None, [], _SITE]  # point, name waited for, deferred, call
    sent = all_gather_json(mine, operation=what, timeout_s=s.timeout_s)
    rows = [(int(row[0]), row[1], list(row[2])) for row in sent]
    ready = common_names(rows)
    going = goes_on(rows, set(ready))
    for name in ready:  # the others start these, in this order, now
        if is_deferred(name):
            start_own(name)
        else:
            _stand_in_call(s, device)
    if not any(going):  # the others raise this too (matching.py)
        descs = [(str(row[-1]), None) for row in sent]
        raise HorovodMismatchError(render_mismatch(descs, stall_text(rows)))
    live = [p for p, _, _ in rows if p != Point.JOINED]
    if live and all(p == Point.COLLECTIVE for p in live):
        _stand_in_call(s, device)  # every other rank goes on to its collective


def _stand_in_call(s: Session, device: int) -> None:
    """Answer one collective's check with a joined row; do what the callers ask."""
    next_call()
    table = dbg.gather_calls(dbg.JOINED, None, timeout_s=s.timeout_s, site=_SITE)
    if len(table.joined()) == len(table.rows):
        return
    sent = all_gather_json([_SITE, None], operation=f"{_SITE}: standing in", timeout_s=s.timeout_s)
    spec = agreed(table, sent)
    if spec is not None:
        _perform(s, spec, device, sender=min(set(range(len(sent))) - set(table.joined())))


def _perform(s: Session, spec: Spec, device: int, sender: int) -> None:
    """Take part in the callers' collective: a barrier, or all-reduces of zeros."""
    if "barrier" in spec:
        comm_barrier(timeout_s=s.timeout_s, debug=False)
        return
    works = []
    for entry in _checked(spec["zeros"], sender):
        kind, dtype, length, op = entry
        where = torch.device("cpu") if kind == "cpu" else _cuda(device)
        zeros = torch.zeros(length, dtype=_DTYPES[dtype], device=where)
        works.append(dist.all_reduce(zeros, op=REDUCE_OPS[op], async_op=True))
    for work in works:
        wait(work, f"{_SITE}: standing in for an allreduce", s.timeout_s)


def _checked(entries: object, sender: int) -> list[list[Any]]:
    """The zeros to send, as another rank described them: checked field by field."""
    ok = isinstance(entries, list) and all(
        isinstance(e, list)
        and len(e) == 4
        and e[0] in ("cpu", "cuda")
        and e[1] in _DTYPES
        and type(e[2]) is int
        and e[2] >= 0
        and e[3] in REDUCE_OPS
        for e in entries
    )
    if not ok:
        raise PayloadError(dist.get_rank(), _SITE, sender, "expected [[device, dtype, n, op]]")
    return entries  # type: ignore[return-value]


def _cuda(device: int) -> torch.device:
    return torch.device("cuda", device if device >= 0 else torch.cuda.current_device())


# -- DistributedOptimizer steps ---------------------------------------------------------
_PER_SLOT = 1 << 24
"""A beacon's second integer: optimizer slot times this, plus the bucket."""


class StepBeacon:
    """A bucket's announcement, sent before its all-reduce and waited for in ``step()``.

    Shaped as a matching round's first exchange, so a joined rank waiting in one
    reads it; while no rank has joined it is one tiny all-gather nobody waits on early.
    One per bucket, not per step: a rank may make other calls between two buckets
    (launched at backward, then an ``hvd.allreduce``, then the rest at ``step()``),
    and the joined rank must answer each in that order.
    """

    def __init__(self, slot: int, bucket: int) -> None:
        self.slot = slot * _PER_SLOT + bucket
        row = torch.tensor([int(Point.STEP), self.slot], dtype=torch.int64, device=scratch_device())
        self.table = row.new_empty(2 * dist.get_world_size())
        self.work = all_gather_single(self.table, row, async_op=True)

    def finish(self, desc: str, timeout_s: float) -> None:
        """Wait; every rank not joined must be in the same optimizer's step."""
        wait(self.work, desc, timeout_s)
        rows = self.table.view(-1, 2).tolist()
        odd = [
            r
            for r, (p, k) in enumerate(rows)
            if p != Point.JOINED and (p, k) != (Point.STEP, self.slot)
        ]
        if odd:
            raise HorovodMismatchError(
                f"rank {dist.get_rank()}: manygpu.horovod: ranks disagree on a collective: "
                f"{desc} met another call on {ranks_text(odd)} (every rank must step the same "
                "DistributedOptimizer at the same point)"
            )


def _stand_in_step(s: Session, quick: Sequence[Sequence[int]]) -> None:
    """Zeros for the bucket the others announced, of the optimizer they step."""
    slots = {k for p, k in quick if p != Point.JOINED}
    if len(slots) != 1 or any(p not in (Point.STEP, Point.JOINED) for p, _ in quick):
        raise HorovodMismatchError(
            f"rank {s.topology.rank}: manygpu.horovod: while this rank stood in (hvd.join), "
            "some ranks stepped a DistributedOptimizer and others made another call"
        )
    slot, bucket = divmod(slots.pop(), _PER_SLOT)
    sync: GradientSync | None = registered(slot)
    if sync is None:
        raise UsageError(
            f"rank {s.topology.rank}: hvd.join(): the others step DistributedOptimizer #{slot}, "
            "which this rank does not hold; build every DistributedOptimizer on every rank "
            "and keep it until join() returns"
        )
    if not 0 <= bucket < len(sync.buckets):
        raise HorovodMismatchError(
            f"rank {s.topology.rank}: hvd.join(): the others announce bucket {bucket + 1} of "
            f"DistributedOptimizer #{slot}, which has {len(sync.buckets)} here"
        )
    if sync.debug:  # the callers check each bucket first (grad_sync.py)
        dbg.gather_calls(dbg.JOINED, None, timeout_s=s.timeout_s, site=_SITE)
    next_call(sync.scope)
    params = [sync.params[i] for i in sync.buckets[bucket]]
    length = sum(p.numel() for p in params) + 2 * len(params)  # values, then two flags each
    sent, _ = sync.compression.compress(params[0].new_zeros(length))
    work = dist.all_reduce(sent, group=sync.scope.group, async_op=True)
    wait(work, f"{_SITE}: standing in for {sync.describe(bucket)}", s.timeout_s)
