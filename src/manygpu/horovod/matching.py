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

It owns the names: the names of this rank's pending calls (:func:`claim`
refuses a second call with one, as Horovod), which of them are deferred
(name -> handle, in call order), and whether this rank is in a round now.
A deferred call is held in :mod:`manygpu.horovod.pending` (:func:`pending.reserve
<manygpu.horovod.pending.reserve>`) and started there once every rank has made it
(:func:`pending.begin <manygpu.horovod.pending.begin>`); each round tells
:mod:`manygpu.horovod.joining` which ranks are in ``hvd.join()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from manygpu.comm.common import active, all_gather_single, scratch_device, wait
from manygpu.comm.debug import CollectiveMismatchError
from manygpu.comm.objects import all_gather_json
from manygpu.errors import CollectiveTimeoutError, UsageError
from manygpu.horovod import pending
from manygpu.horovod.basics import Scope, owned, session
from manygpu.horovod.joining import note_round
from manygpu.horovod.reports import (
    HorovodMismatchError,
    calls_made,
    named_stall,
    render_mismatch,
)


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


@dataclass
class _Names:
    """This rank's named calls: pending, deferred, and whether a round is under way."""

    pending: set[str] = field(default_factory=set)
    """Names of the pending operations: Horovod refuses a second call with one of them."""
    deferred: dict[str, int] = field(default_factory=dict)
    """Named calls made here but not yet by every rank: name -> handle, in call order."""
    meeting: bool = False
    """Whether this rank is matching named calls now (the calls it starts then do not)."""


def claim(kind: str, name: str | None) -> str | None:
    """Horovod's name for a call (``allreduce.loss``); refused while one by that name is pending.

    Horovod matches calls across ranks by name, so it refuses a second
    ``allreduce_async(..., name='x')`` before the first is synchronized, with a
    ``ValueError`` at the second call. Checked before any collective starts:
    every rank refuses the same call, and none is left waiting.
    """
    if name is None:
        return None
    key = f"{kind}.{name}"
    if key in owned(_Names).pending:
        raise UsageError(
            f"hvd.{kind}: another {kind} named {name!r} is still pending; call "
            "hvd.synchronize on its handle first, or give this one a different name"
        )
    return key


def launch(
    start: Callable[[], pending.Started], description: str, scope: Scope, name: str | None
) -> int:
    """Start a call now, or, a named one on the whole job, once every rank has made it.

    Unnamed calls and those of a process set are matched by order, started at once.
    """
    if name is None or not scope.whole or not active():
        works, finish, seq = start()
        handle = pending.submit(works, finish, description, seq, scope, name=name)
        if name is not None:
            owned(_Names).pending.add(name)
        return handle
    handle = pending.reserve(start, description, scope, name)
    names = owned(_Names)
    names.pending.add(name)
    names.deferred[name] = handle
    meet(Point.SUBMIT, description)
    return handle


def release(name: str | None) -> None:
    """A named call is over (synchronized, or never will be): its name is free again."""
    if name is None:
        return
    names = owned(_Names)
    names.pending.discard(name)
    names.deferred.pop(name, None)


def is_deferred(name: str) -> bool:
    """Whether this rank made a named call of that name that has not started yet."""
    return name in owned(_Names).deferred


def start_own(name: str) -> None:
    """Start a deferred call of this rank's now, outside a round of its own (a rank in
    ``hvd.join()`` that made it before joining): its checks run as a live rank's,
    without meeting again."""
    names = owned(_Names)
    names.meeting = True
    try:
        pending.begin(names.deferred.pop(name))
    finally:
        names.meeting = False


def meet(point: Point, desc: str, wanted: str | None = None) -> None:
    """Take part in rounds until this rank may go on (see the module's docstring).

    ``desc`` names this rank's call in errors; ``wanted`` is the name ``synchronize``
    waits for. Calls started inside a round run their own checks without meeting again.
    """
    names = owned(_Names)
    if names.meeting:
        return
    names.meeting = True
    try:
        while not _round(names, point, desc, wanted):
            pass
    except CollectiveTimeoutError as exc:
        # A rank that never came: the stall notes name it, as for any collective.
        named = named_stall(exc, calls_made() + 1, desc)
        if named is None:
            raise
        raise named from exc
    finally:
        names.meeting = False


def _round(names: _Names, point: Point, desc: str, wanted: str | None) -> bool:
    """One round: exchange tables, start what every rank has made; whether this rank goes on."""
    deferred = list(names.deferred)
    s = session()
    mine = torch.tensor([int(point), len(deferred)], dtype=torch.int64, device=scratch_device())
    table = mine.new_empty(2 * s.topology.size)
    what = "hvd: matching named calls across ranks"
    wait(all_gather_single(table, mine, async_op=True), what, s.timeout_s)
    quick = table.view(-1, 2).tolist()
    if all(p == Point.COLLECTIVE and n == 0 for p, n in quick):
        note_round([])
        return True  # the usual case: nothing deferred anywhere, everyone at a collective
    note_round([r for r, (p, _) in enumerate(quick) if p == Point.JOINED])
    sent = all_gather_json(
        [int(point), wanted, deferred, desc], operation=what, timeout_s=s.timeout_s
    )
    rows: list[Row] = [(int(p), w, list(n)) for p, w, n, _ in sent]
    ready = common_names(rows)
    for name in ready:
        pending.begin(names.deferred.pop(name))
    going = goes_on(rows, set(ready))
    if not any(going):
        raise _stall([str(d) for *_, d in sent], rows)
    return going[s.topology.rank]


def _stall(descs: list[str], rows: Sequence[Row]) -> CollectiveMismatchError:
    """Every rank's call, as a mismatch table (``hvd.HorovodMismatchError``)."""
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
            out.append(False)  # a joined rank's own loop decides (stand_in.py)
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
