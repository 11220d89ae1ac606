"""A host's launcher under a launch over several hosts: its two ties to the driver.

The driver (:mod:`manygpu.launch.hostrun`) starts ``manygpu launch --driven``
on every host, over ssh or here, with a pipe as its stdin that it never
writes. That pipe is the lifeline: when the driver exits, is killed, or its
ssh connection drops, the pipe closes (ssh forwards the end of its input), and
the launcher stops its workers as on SIGTERM. No pseudo-terminal is needed,
so stdout and stderr stay apart and ssh passes the exit code through.

Failures go back as tagged JSON lines on stderr, so the driver can put the
job's first failure first over every host (:mod:`manygpu.launch.blame`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from dataclasses import dataclass

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


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """How one rank ended, as a host reports it to the driver."""

    rank: int
    exit_code: int
    time_ns: int
    consequence: bool
    text: str
    """The launcher's words, e.g. ``rank 3 failed with exit code 3: ValueError: boom``."""


def report(outcome: blame.Outcome, text: str) -> None:
    """Write one rank's outcome for the driver (stderr, one line)."""
    record = {
        "rank": outcome.rank,
        "exit_code": outcome.exit_code,
        "time_ns": outcome.time_ns,
        "consequence": outcome.consequence,
        "text": text,
    }
    print(TAG + json.dumps(record), file=sys.stderr, flush=True)


def parse(line: str) -> RankOutcome | None:
    """The outcome on ``line``, ``None`` when it is not one."""
    if not line.startswith(TAG):
        return None
    try:
        record = json.loads(line[len(TAG) :])
        return RankOutcome(
            rank=int(record["rank"]),
            exit_code=int(record["exit_code"]),
            time_ns=int(record["time_ns"]),
            consequence=bool(record["consequence"]),
            text=str(record["text"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
