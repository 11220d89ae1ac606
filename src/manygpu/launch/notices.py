"""The launcher passes a scheduler's warning signal on to its workers.

``srun manygpu launch`` makes the launchers Slurm's tasks, so ``--signal=USR1@N``
(and ``scancel --signal=USR1``) reach them, not the ranks: torch's agent does
not handle SIGUSR1, whose default action would end the launcher and, with it,
every rank before a save. The launcher instead sends it to its workers (each
records it, :mod:`manygpu.runtime.notice`; a ``Checkpointer`` saves at the next
step boundary and stops, and the job ends with exit code 0) and goes on
supervising them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import psutil

from manygpu.runtime.notice import WARNING


def _forward(signum: int, frame: Any) -> None:
    for child in psutil.Process().children():  # the workers torch's agent started
        with contextlib.suppress(psutil.Error):
            child.send_signal(signum)


@contextlib.contextmanager
def forwarding() -> Iterator[None]:
    """While the job runs, SIGUSR1 to this launcher goes to its workers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(WARNING, _forward)
    signal.siginterrupt(WARNING, False)
    try:
        yield
    finally:
        signal.signal(WARNING, previous)
