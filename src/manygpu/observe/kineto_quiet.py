"""torch's profiler start and stop, without its C++ chatter on every rank.

Kineto (torch.profiler's C++ side) writes ``USDT: ... profiler_start`` and
``profiler_stop`` (and, at some log levels, ``STAGE: ...``) straight to file
descriptor 2 at each start and stop: no Python logger to quiet, and no
``KINETO_LOG_LEVEL`` that hides them keeps its errors (USDT ranks above ERROR).
So stderr's descriptor is pointed at a scratch file around those calls only, and
everything written there except those lines is written back to stderr after:
a real error still shows, in its place.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

CHATTER = re.compile(rb"^(USDT|STAGE):\S* \S+ \d+:\d+ \S+\] ")
"""Kineto's progress lines: ``USDT:2026-11-28 02:36:37 22556:22556 File.cpp:52] ...``."""


def keep(text: bytes) -> bytes:
    """``text`` without Kineto's progress lines (every other line kept, in order)."""
    return b"".join(line for line in text.splitlines(keepends=True) if not CHATTER.match(line))


class QuietProfilerCalls:
    """Runs torch's profiler calls with Kineto's progress lines dropped from stderr.

    One scratch file per profile window; each call is two ``dup2``s (microseconds).
    """

    def __init__(self) -> None:
        self._scratch: IO[bytes] | None = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):  # no descriptor 2 (an embedded host)
            yield
            return
        if self._scratch is None:
            self._scratch = tempfile.TemporaryFile()  # noqa: SIM115 (kept for the window; close())
        scratch = self._scratch
        start = scratch.seek(0, os.SEEK_END)
        os.dup2(scratch.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()  # Python's own lines written meanwhile: into the scratch too
            os.dup2(saved, 2)
            os.close(saved)
            scratch.seek(start)
            rest = keep(scratch.read())
            if rest:
                os.write(2, rest)

    def close(self) -> None:
        """Drop the scratch file (the window ended)."""
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
