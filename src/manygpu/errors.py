"""Exception types. Each says what is wrong and how to fix it in one line.

The CLI turns :class:`UsageError` (bad input) into a one-line message and exit
code 2; everything else keeps its traceback because it is a bug or a failure of
the job itself, not of how it was asked for.
"""

from __future__ import annotations

import re


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
    When the backend's words say a peer went away instead, the error made is a
    :class:`PeerLostError` (still a ``CollectiveTimeoutError`` to ``except``).
    """

    def __new__(cls, *args: object, **kwargs: object) -> CollectiveTimeoutError:
        detail = kwargs.get("detail", args[3] if len(args) > 3 else "")
        if cls is CollectiveTimeoutError and peer_lost(str(detail)):
            cls = PeerLostError
        return super().__new__(cls)

    def __init__(
        self, rank: int, operation: str, timeout_s: float | None, detail: str = ""
    ) -> None:
        self.rank = rank
        self.operation = operation
        self.timeout_s = timeout_s
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        t = self.timeout_s
        within = f"{t:g}s" if t is not None else "the process group's timeout"
        msg = (
            f"rank {self.rank}: {self.operation} did not complete within {within}; "
            "another rank never joined it (check that every rank runs the same "
            "collectives in the same order, or raise the timeout)"
        )
        return msg + (f" [{self.detail}]" if self.detail else "")

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from its message and fields, whatever a subclass's __init__ takes.
        return (_rebuilt, (type(self), str(self), dict(self.__dict__)))


def _rebuilt(cls: type[Exception], message: str, state: dict[str, object]) -> Exception:
    """An unpickled :class:`CollectiveTimeoutError` (or subclass): message and fields."""
    exc = Exception.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(state)
    return exc


class PeerLostError(CollectiveTimeoutError):
    """A collective failed because a peer rank died or lost its connection: not a
    timeout, and not this rank's fault; the peer's own failure is the cause."""

    def _message(self) -> str:
        return (
            f"rank {self.rank}: {self.operation} failed: a peer rank died or lost its "
            f"connection ({backend_words(self.detail)}); its own failure is the cause"
        )


_GLOO_SOURCE = re.compile(r"^\s*\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def backend_words(detail: str) -> str:
    """What a backend said, without its source location and its advice: "Connection
    closed by peer [10.0.0.2]:41639" (the address kept: a launcher names the host)."""
    text = _GLOO_SOURCE.sub("", detail.strip().splitlines()[0] if detail.strip() else "")
    return text.split(". ", 1)[0].rstrip(".")[:200] or "no words from the backend"


class CheckpointError(ManyGPUError, RuntimeError):
    """A checkpoint is missing, partial, corrupt or unsafe; the message names what and where."""


class LaunchError(ManyGPUError, RuntimeError):
    """The launched job failed; carries the failing worker's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
