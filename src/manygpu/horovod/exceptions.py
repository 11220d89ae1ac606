"""Horovod's public exceptions, and manygpu's collective failures in a form scripts catch.

Elastic-style Horovod scripts wrap a training step in ``try: ... except
hvd.HorovodInternalError:`` (a collective failed: a peer died, the job broke)
and ``except hvd.HostsUpdatedInterrupt:`` (hosts were added or removed).
Both are plain :class:`RuntimeError` subclasses, as in Horovod. manygpu's own
failure of a collective, :class:`~manygpu.errors.CollectiveTimeoutError`, is
raised by manygpu.horovod as :class:`HorovodCollectiveError`, which is both,
so the script's ``except`` and manygpu's own handlers each see their type.
"""

from __future__ import annotations

from manygpu.errors import CollectiveTimeoutError


class HorovodInternalError(RuntimeError):
    """A collective operation failed (a peer exited, a connection broke, a timeout)."""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts in the job changed.

    manygpu.horovod never raises it (membership changes restart the job under
    ``manygpu launch --nnodes MIN:MAX``); it exists so scripts that catch it run.
    """

    def __init__(self, skip_sync: bool) -> None:
        super().__init__(skip_sync)
        self.skip_sync = skip_sync
        """Whether the reset may skip syncing state (Horovod's meaning)."""


class HorovodCollectiveError(CollectiveTimeoutError, HorovodInternalError):
    """manygpu's :class:`CollectiveTimeoutError`, catchable as Horovod's internal error."""

    def __init__(self, cause: CollectiveTimeoutError) -> None:
        self.rank = cause.rank
        self.operation = cause.operation
        self.timeout_s = cause.timeout_s
        self.detail = getattr(cause, "detail", "")
        # The message is already built (with the missing ranks, or the lost peer):
        # keep it as is rather than composing it again from its parts.
        Exception.__init__(self, str(cause))


def internal(exc: CollectiveTimeoutError) -> CollectiveTimeoutError:
    """``exc`` as a :class:`HorovodCollectiveError` (unchanged if it is one already)."""
    return exc if isinstance(exc, HorovodInternalError) else HorovodCollectiveError(exc)
