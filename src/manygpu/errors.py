"""Exception types. Each says what is wrong and how to fix it in one line.

The CLI turns :class:`UsageError` (bad input) into a one-line message and exit
code 2; everything else keeps its traceback because it is a bug or a failure of
the job itself, not of how it was asked for.
"""

from __future__ import annotations


class ManyGPUError(Exception):
    """Base class of every error manygpu raises on purpose."""


class UsageError(ManyGPUError, ValueError):
    """Bad input from the user: a wrong option, size, name or combination."""


_PEER_LOST = ("closed by peer", "reset by peer", "read error", "broken pipe", "refused")


def peer_lost(detail: str) -> bool:
    """Whether a backend's message says a peer went away (rather than a timeout)."""
    text = detail.lower()
    return any(hint in text for hint in _PEER_LOST)


class CollectiveTimeoutError(ManyGPUError, RuntimeError):
    """A collective did not complete in time: some rank never joined it.

    Raised instead of hanging, with the rank that waited and the operation it
    waited in, so the person reading the log knows where the ranks diverged.
    """

    def __init__(
        self, rank: int, operation: str, timeout_s: float | None, detail: str = ""
    ) -> None:
        self.rank = rank
        self.operation = operation
        self.timeout_s = timeout_s
        within = f"{timeout_s:g}s" if timeout_s is not None else "the process group's timeout"
        if peer_lost(detail):
            # Not a timeout: the backend saw a peer go away, typically at once.
            msg = (
                f"rank {rank}: {operation} failed: another rank exited or lost its "
                "connection (its own error, reported first, is the cause)"
            )
        else:
            msg = (
                f"rank {rank}: {operation} did not complete within {within}; "
                "another rank never joined it (check that every rank runs the same "
                "collectives in the same order, or raise the timeout)"
            )
        if detail:
            msg += f" [{detail}]"
        super().__init__(msg)


class CheckpointError(ManyGPUError, RuntimeError):
    """A checkpoint is missing, partial, corrupt or unsafe; the message names what and where."""


class LaunchError(ManyGPUError, RuntimeError):
    """The launched job failed; carries the failing worker's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
