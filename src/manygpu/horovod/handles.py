"""Handles of asynchronous operations: ``poll`` and ``synchronize``, as in Horovod.

An ``*_async`` call starts the backend's work (``async_op=True``) and returns
an integer handle (:mod:`manygpu.horovod.pending` holds them); the work runs in
the backend's threads (gloo) or streams (NCCL) while Python goes on.
``synchronize(handle)`` waits, within the collective timeout, finishes what
Horovod does after the reduction (averaging, scaling, trimming padding) and
returns the result; ``poll(handle)`` says whether it would return at once. A
named call some rank has not made yet is waited for in rounds of
:mod:`manygpu.horovod.matching` until it starts. Like ``allreduce``, these are
calls of the API, above the call path, and keep no state of their own.
"""

from __future__ import annotations

from typing import Any

from manygpu.errors import UsageError
from manygpu.horovod import pending
from manygpu.horovod.matching import Point, meet, release


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` is done (``synchronize`` will not block)."""
    record = pending.get(handle)
    if record is None:
        raise UsageError(f"hvd.poll: unknown handle {handle!r} (already synchronized?)")
    if record.start is not None:
        return False  # a named call some rank has not made yet
    if record.parts is not None:  # a grouped call: done once every part is
        return all(poll(h) for h in record.parts if pending.get(h) is not None)
    return all(work.is_completed() for work in record.works)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its result.

    As Horovod, a handle that is not pending (already synchronized) gives ``None``.
    """
    record = pending.get(handle)
    if record is None:
        return None
    try:
        if record.start is not None:
            # until every rank has made it and it started
            meet(Point.WAIT, record.description, record.name)
    finally:
        record = pending.take(handle) or record  # as started by the rounds, if it was
        release(record.name)  # free even if the wait fails: the call is over
    if record.error is not None:
        raise record.error
    pending.wait_pending(record)  # a failure is an hvd.HorovodInternalError too
    return record.finish()
