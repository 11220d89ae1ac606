"""Schedulers' notices, recorded process-wide: SIGTERM and SIGUSR1 (and a user's Ctrl-C).

A scheduler warns a job before it stops it: SIGTERM (Kubernetes, Slurm's
preemption, ``scontrol requeue``, spot instances) or a signal the user chose,
by convention SIGUSR1 (Slurm's ``--signal=USR1@N``, N seconds before the time
limit). SIGUSR1's default action ends the process, so a rank told "you have N
seconds" would die without a save: the launcher's worker wrapper starts
recording it before the user's script runs, and a ``Checkpointer`` reads the
record at its next step boundary. Signals belong to the process, so the record
does too; only the main thread may install handlers.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

WARNING = signal.SIGUSR1
"""The scheduler's warning signal (Slurm's ``--signal=USR1@N`` convention)."""

_received: list[int] = []
"""Signal numbers in the order they arrived (the first one is the notice)."""


def _on_signal(signum: int, frame: Any) -> None:
    _received.append(signum)


def _install(signum: int) -> bool:
    """Record ``signum`` from now on, unless someone else's handler holds it."""
    current = signal.getsignal(signum)
    if current is not _on_signal and current not in (signal.SIG_DFL, None):
        return False  # the user's own handler (or SIG_IGN): theirs to keep
    signal.signal(signum, _on_signal)
    # Restart interrupted system calls: a gloo/NCCL thread blocked in recv must
    # not see EINTR (it would abort the process) because a notice arrived.
    signal.siginterrupt(signum, False)
    return True


def record_warnings() -> bool:
    """Record SIGUSR1 instead of dying of it (its default action); whether it was set."""
    if threading.current_thread() is not threading.main_thread():
        return False
    return _install(WARNING)


def _on_interrupt(signum: int, frame: Any) -> None:
    """The first Ctrl-C is a notice (save, then stop); a second one stops at once."""
    if signal.SIGINT in _received:
        raise KeyboardInterrupt
    _received.append(signum)


def listen() -> None:
    """Record SIGTERM, SIGUSR1 and a first SIGINT (a Checkpointer saves, then stops,
    on each). SIGINT only while it has Python's default handler: a script's own
    Ctrl-C handling stays the script's."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_signal)
    signal.siginterrupt(signal.SIGTERM, False)
    _install(WARNING)
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_interrupt):
        signal.signal(signal.SIGINT, _on_interrupt)
        signal.siginterrupt(signal.SIGINT, False)


def received() -> int | None:
    """The first notice's signal number, or ``None``."""
    return _received[0] if _received else None


def forget() -> None:
    """Drop what was received (a test's clean slate; a resumed loop's fresh start)."""
    _received.clear()
