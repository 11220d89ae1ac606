"""A host's launcher under a launch over several hosts: its two ties to the driver.

The driver (:mod:`manygpu.launch.hosts.run`) starts ``manygpu launch --driven``
on every host, over ssh or here, with a pipe as its stdin that it never
writes. That pipe is the lifeline: when the driver exits, is killed, or its
ssh connection drops, the pipe closes (ssh forwards the end of its input), and
the launcher stops its workers as on SIGTERM. No pseudo-terminal is needed,
so stdout and stderr stay apart and ssh passes the exit code through.

Failures go back as tagged JSON lines on stderr, so the driver can put the
job's first failure first over every host (:mod:`manygpu.launch.blame`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import replace

from manygpu.launch import blame

TAG = "manygpu-outcome "
"""Prefix of an outcome line; the driver reads these instead of showing them."""


def watch_stdin(fd: int = 0) -> threading.Thread:
    """Send this process SIGTERM once ``fd`` reaches its end (the driver is gone).

    SIGTERM, not an exception: torch's agent turns it into stopping the
    workers (SIGTERM, then SIGKILL after --term-timeout); before the agent has
    workers its default action ends the launcher at once, which is as right.
    """

    def wait() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=wait, name="manygpu-driver-watch", daemon=True)
    thread.start()
    return thread


def report(outcome: blame.Outcome, text: str) -> None:
    """Write one rank's outcome for the driver (stderr, one line), ``text`` its whole line,
    e.g. ``rank 3 failed with exit code 3: ValueError: boom``."""
    print(TAG + replace(outcome, how=text).to_json(), file=sys.stderr, flush=True)


def parse(line: str) -> blame.Outcome | None:
    """The outcome on ``line``, ``None`` when it is not one."""
    return blame.Outcome.from_json(line[len(TAG) :]) if line.startswith(TAG) else None
