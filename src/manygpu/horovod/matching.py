"""Named calls meet by name, as Horovod's coordinator matches them, not by call order.

Horovod starts an operation once every rank has submitted one of that name,
so ranks may make named asynchronous calls in different orders, or one rank
may make its call before a barrier and the others after it. torch.distributed
matches collectives by order alone, so a named call on the whole job is not
started when it is made: it waits in this rank's table of deferred calls.
Whenever a rank reaches a point of the job (a named call, an explicit
collective, ``synchronize`` on a call not started), the ranks exchange their
tables in one *round* and start, in rank 0's call order, every named call
that all of them have made. A round costs one tiny all-gather of integers;
the names travel (as JSON) only while some rank has a deferred call.

Who goes on after a round: a rank that made a named call at once (as
Horovod returns a handle at once); a rank waiting in ``synchronize`` once its
call started; a rank at an explicit collective once every rank is at one (the
collective itself is then matched by order, as before). A round in which no
rank may go on is a deadlock: every rank is blocked, so none can make the call
the others wait for; every rank raises the same ``hvd.HorovodMismatchError``,
naming each rank's call (where Horovod would report a stall).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch

from manygpu.comm.common import all_gather_single, scratch_device, wait
from manygpu.comm.debug import CollectiveMismatchError
from manygpu.comm.objects import all_gather_json
from manygpu.errors import CollectiveTimeoutError
from manygpu.horovod.basics import Session, session


class Point(enum.IntEnum):
    """Why a rank meets the others."""

    COLLECTIVE = 0
    """An explicit collective, matched by order once every rank is at one."""
    SUBMIT = 1
    """A named call was just made: start it if every rank has, and go on anyway."""
    WAIT = 2
    """``synchronize`` on a named call not started yet: go on once it starts."""
    JOINED = 3
    """In ``hvd.join()``: stands in for the others' calls (:mod:`manygpu.horovod.joining`);
    ignored when deciding what starts and who goes on."""
    STEP = 4
    """A DistributedOptimizer step's buckets follow (sent without a round; only a joined
    rank reads it, to stand in for them)."""


Row = tuple[int, str | None, list[str]]
"""One rank's part of a round: its :class:`Point`, the name it waits for, its deferred names."""


def meet(point: Point, desc: str, wanted: str | None = None) -> None:
    """Take part in rounds until this rank may go on (see the module's docstring).

    ``desc`` names this rank's call in errors; ``wanted`` is the name ``synchronize``
    waits for. Calls started inside a round run their own checks without meeting again.
    """
    s = session()
    if s.meeting:
        return
    s.meeting = True
    try:
        while not _round(s, point, desc, wanted):
            pass
    except CollectiveTimeoutError as exc:
        # A rank that never came: the stall notes name it, as for any collective.
        from manygpu.horovod.checks import named_stall  # checks meets through this module

        named = named_stall(exc, s.calls + 1, desc)
        if named is None:
            raise
        raise named from exc
    finally:
        s.meeting = False


def _round(s: Session, point: Point, desc: str, wanted: str | None) -> bool:
    """One round: exchange tables, start what every rank has made; whether this rank goes on."""
    names = list(s.deferred)
    mine = torch.tensor([int(point), len(names)], dtype=torch.int64, device=scratch_device())
    table = mine.new_empty(2 * s.topology.size)
    what = "hvd: matching named calls across ranks"
    wait(all_gather_single(table, mine, async_op=True), what, s.timeout_s)
    quick = table.view(-1, 2).tolist()
    if all(p == Point.COLLECTIVE and n == 0 for p, n in quick):
        s.joined = []
        return True  # the usual case: nothing deferred anywhere, everyone at a collective
    s.joined = [r for r, (p, _) in enumerate(quick) if p == Point.JOINED]
    sent = all_gather_json([int(point), wanted, names, desc], operation=what, timeout_s=s.timeout_s)
    rows: list[Row] = [(int(p), w, list(n)) for p, w, n, _ in sent]
    ready = common_names(rows)
    for name in ready:
        start_deferred(s, s.deferred.pop(name))
    going = goes_on(rows, set(ready))
    if not any(going):
        raise _stall([str(d) for *_, d in sent], rows)
    return going[s.topology.rank]


def _stall(descs: list[str], rows: Sequence[Row]) -> CollectiveMismatchError:
    """Every rank's call, as a mismatch table (``hvd.HorovodMismatchError``)."""
    from manygpu.horovod.checks import HorovodMismatchError, render_mismatch

    return HorovodMismatchError(render_mismatch([(d, None) for d in descs], stall_text(rows)))


def common_names(rows: Sequence[Row]) -> list[str]:
    """The names every rank has deferred, in rank 0's call order (the order all start them).

    Joined ranks (``hvd.join``) are left out: they stand in for every call, as in Horovod.
    """
    live = [names for point, _, names in rows if point != Point.JOINED]
    if not live:
        return []
    others = [set(names) for names in live[1:]]
    return [n for n in live[0] if all(n in o for o in others)]


def goes_on(rows: Sequence[Row], started: set[str]) -> list[bool]:
    """For each rank, whether it leaves the round (alike on every rank: same table)."""
    at_collective = all(p in (Point.COLLECTIVE, Point.JOINED) for p, _, _ in rows)
    out = []
    for point, wanted, _ in rows:
        if point == Point.JOINED:
            out.append(False)  # a joined rank's own loop decides (joining.py)
        elif point == Point.SUBMIT:
            out.append(True)
        elif point == Point.WAIT:
            out.append(wanted in started)
        else:
            out.append(at_collective)
    return out


def stall_text(rows: Sequence[Row]) -> str:
    """Each rank's wait, and the named calls some ranks made and others did not."""
    parts = []
    for rank, (point, wanted, names) in enumerate(rows):
        doing = f"waits for {wanted!r}" if point == Point.WAIT else "waits in a collective"
        held = f" (made {', '.join(map(repr, names))})" if names else ""
        parts.append(f"rank {rank} {doing}{held}")
    return (
        "manygpu.horovod: no rank can go on: " + "; ".join(parts) + ". A named call starts "
        "once every rank has made it: make the same named calls on every rank before "
        "waiting for them"
    )


def start_deferred(s: Session, handle: int) -> None:
    """Start a deferred call now that every rank has made it; a failure is kept for
    ``synchronize`` (the checks raise it alike on every rank)."""
    pending = s.pending[handle]
    start, pending.start = pending.start, None
    if start is None:
        return
    try:
        works, finish, seq = start()
    except Exception as exc:  # e.g. a mismatch: every rank raises it, at this same call
        pending.error = exc
        return
    pending.works = [w for w in works if w is not None]
    pending.finish, pending.seq = finish, seq


def unstarted() -> Any:
    """Placeholder ``finish`` of a deferred call: replaced when the call starts."""
    raise AssertionError("a deferred named call was finished before it started")
