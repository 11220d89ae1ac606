"""Handles of asynchronous operations: ``poll`` and ``synchronize``, as in Horovod.

An ``*_async`` call starts the backend's work (``async_op=True``) and returns
an integer handle; the work runs in the backend's threads (gloo) or streams
(NCCL) while Python goes on. ``synchronize(handle)`` waits, within the
collective timeout, finishes what Horovod does after the reduction (averaging,
scaling, trimming padding) and returns the result; ``poll(handle)`` says
whether it would return at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from manygpu.comm.common import active
from manygpu.errors import UsageError
from manygpu.horovod.basics import Pending, session
from manygpu.horovod.checks import wait_pending
from manygpu.horovod.matching import Point, meet, unstarted

if TYPE_CHECKING:
    from manygpu.horovod.process_sets import Scope

Started = tuple[list[dist.Work | None], Callable[[], Any], int]
"""What starting a call gives: its works, what finishes it, its call number."""


def submit(
    works: list[dist.Work | None],
    finish: Callable[[], Any],
    description: str,
    seq: int,
    scope: Scope | None = None,
    name: str | None = None,
) -> int:
    """Register started works (on ``scope``'s ranks, by default the job's); the handle
    ``synchronize`` takes."""
    s = session()
    handle = next(s.handles)
    real = [w for w in works if w is not None]
    s.pending[handle] = Pending(
        works=real, finish=finish, description=description, seq=seq, scope=scope, name=name
    )
    if name is not None:
        s.names.add(name)
    return handle


def launch(start: Callable[[], Started], description: str, scope: Scope, name: str | None) -> int:
    """Start a call now, or, a named one on the whole job, once every rank has made it.

    Horovod matches named calls across ranks by name (:mod:`manygpu.horovod.matching`);
    unnamed ones and those of a process set are matched by order, started at once.
    """
    if name is None or not scope.whole or not active():
        works, finish, seq = start()
        return submit(works, finish, description, seq, scope, name=name)
    s = session()
    handle = next(s.handles)
    s.pending[handle] = Pending(
        works=[], finish=unstarted, description=description, seq=0, scope=scope, name=name,
        start=start,
    )  # fmt: skip
    s.names.add(name)
    s.deferred[name] = handle
    meet(Point.SUBMIT, description)
    return handle


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
    if key in session().names:
        raise UsageError(
            f"hvd.{kind}: another {kind} named {name!r} is still pending; call "
            "hvd.synchronize on its handle first, or give this one a different name"
        )
    return key


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` is done (``synchronize`` will not block)."""
    pending = session().pending.get(handle)
    if pending is None:
        raise UsageError(f"hvd.poll: unknown handle {handle!r} (already synchronized?)")
    if pending.start is not None:
        return False  # a named call some rank has not made yet
    if pending.parts is not None:  # a grouped call: done once every part is
        return all(poll(h) for h in pending.parts if h in session().pending)
    return all(work.is_completed() for work in pending.works)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its result.

    As Horovod, a handle that is not pending (already synchronized) gives ``None``.
    """
    s = session()
    pending = s.pending.get(handle)
    if pending is None:
        return None
    try:
        if pending.start is not None:
            # until every rank has made it and it started
            meet(Point.WAIT, pending.description, pending.name)
    finally:
        s.pending.pop(handle, None)
        s.names.discard(pending.name or "")  # free even if the wait fails: the call is over
        s.deferred.pop(pending.name or "", None)
    if pending.error is not None:
        raise pending.error
    wait_pending(pending)  # a failure is an hvd.HorovodInternalError too
    return pending.finish()
