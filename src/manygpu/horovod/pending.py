"""The last step of a call: started works under an integer handle, until ``synchronize``.

An ``*_async`` call starts the backend's work (``async_op=True``) and returns
an integer handle; the work runs in the backend's threads (gloo) or streams
(NCCL) while Python goes on. This module owns the table of those handles: a
call started at once is entered with :func:`submit`; a named call on the whole
job that not every rank has made yet is entered unstarted with
:func:`reserve` (:mod:`manygpu.horovod.matching` decides which), and started
here with :func:`begin` once every rank has made it. Records are frozen and
replaced, never changed in place, so only this module changes what a handle
holds. ``hvd.synchronize`` and ``hvd.poll`` (:mod:`manygpu.horovod.handles`)
read and take the records.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from manygpu.comm.common import wait
from manygpu.errors import CollectiveTimeoutError
from manygpu.horovod.basics import Scope, owned, session
from manygpu.horovod.reports import named_stall

Started = tuple[list[dist.Work | None], Callable[[], Any], int]
"""What starting a call gives: its works, what finishes it, its call number."""


@dataclass(frozen=True)
class Pending:
    """An asynchronous operation: the backend's works and what turns them into the result."""

    works: list[dist.Work]
    finish: Callable[[], Any]
    """Run once every work is done: scaling, trimming, copying back; returns the result."""
    description: str
    """How errors name it: ``allreduce('loss', float32[4], op=Average)``."""
    seq: int
    """This rank's number for the call, shown when a stall is reported."""
    scope: Scope | None = None
    """The process set it runs in; ``None`` for the whole job."""
    name: str | None = None
    """Horovod's name for it (``allreduce.loss``) while pending, when the user gave one."""
    start: Callable[[], Started] | None = None
    """A named call not started yet: what starts it once every rank has made it
    (:func:`begin`); ``None`` once started."""
    error: Exception | None = None
    """Why starting it failed (alike on every rank); ``synchronize`` raises it."""
    parts: list[int] | None = None
    """A grouped call's merged handle: the parts' handles, which ``poll`` asks (a named
    part may start after the merged handle was made)."""


@dataclass
class _Handles:
    """The session's pending operations, by handle."""

    table: dict[int, Pending] = field(default_factory=dict)
    numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    """Horovod's handles are integers; the next one."""


def submit(
    works: list[dist.Work | None],
    finish: Callable[[], Any],
    description: str,
    seq: int,
    scope: Scope | None = None,
    name: str | None = None,
    parts: list[int] | None = None,
) -> int:
    """Register started works (on ``scope``'s ranks, by default the job's); the handle
    ``synchronize`` takes."""
    handles = owned(_Handles)
    handle = next(handles.numbers)
    real = [w for w in works if w is not None]
    handles.table[handle] = Pending(
        works=real, finish=finish, description=description, seq=seq, scope=scope, name=name,
        parts=parts,
    )  # fmt: skip
    return handle


def reserve(start: Callable[[], Started], description: str, scope: Scope, name: str) -> int:
    """A handle for a named call that starts later, when :func:`begin` is called."""
    handles = owned(_Handles)
    handle = next(handles.numbers)
    handles.table[handle] = Pending(
        works=[], finish=_unstarted, description=description, seq=0, scope=scope, name=name,
        start=start,
    )  # fmt: skip
    return handle


def begin(handle: int) -> None:
    """Start a reserved call now that every rank has made it; a failure is kept for
    ``synchronize`` (the checks raise it alike on every rank)."""
    table = owned(_Handles).table
    record = table.get(handle)
    if record is None or record.start is None:
        return
    table[handle] = replace(record, start=None)  # started, or failed: never started twice
    try:
        works, finish, seq = record.start()
    except Exception as exc:  # e.g. a mismatch: every rank raises it, at this same call
        table[handle] = replace(record, start=None, error=exc)
        return
    real = [w for w in works if w is not None]
    table[handle] = replace(record, start=None, works=real, finish=finish, seq=seq)


def get(handle: int) -> Pending | None:
    """The record behind ``handle`` as it is now; ``None`` when not pending."""
    return owned(_Handles).table.get(handle)


def take(handle: int) -> Pending | None:
    """Forget ``handle`` (it is being synchronized); its record as it was last."""
    return owned(_Handles).table.pop(handle, None)


def wait_pending(pending: Pending) -> None:
    """Wait for an asynchronous operation's works; a stall names the missing ranks."""
    for work in pending.works:
        try:
            wait(work, pending.description, session().timeout_s)
        except CollectiveTimeoutError as exc:
            named = named_stall(exc, pending.seq, pending.description, pending.scope)
            if named is None:
                raise
            raise named from exc


def _unstarted() -> Any:
    """Placeholder ``finish`` of a reserved call: replaced when the call starts."""
    raise AssertionError("a deferred named call was finished before it started")
