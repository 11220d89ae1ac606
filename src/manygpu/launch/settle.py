"""Let every worker reach a configuration error before the agent stops the others.

A configuration error (a :class:`~manygpu.errors.UsageError`: ``Parallel(strategy=
"fdsp")``) hits every rank alike, and the launcher says it once for all of them:
``manygpu: ranks 0, 1: unknown strategy 'fdsp'; ...``. But the ranks reach it at
slightly different times, and torch's agent stops the survivors (SIGTERM) as soon
as it sees the first failure: on a loaded machine a rank a few hundred ms behind
was stopped before it got there, and the job's one line became two (the error for
rank 0, then rank 1 "killed by SIGTERM, a consequence").

So when every worker that has failed so far failed with a configuration error,
the agent first waits, up to :data:`SETTLE_S`, for the others to end on their
own. Any other failure is stopped at once, as torch does.
"""

from __future__ import annotations

import json
import time
from typing import Any

from manygpu.launch.blame import USAGE_PREFIX

SETTLE_S = 3.0
"""The longest the agent waits for the other workers after a configuration error."""


def settle_configuration_error(pcontext: Any, settle_s: float = SETTLE_S) -> None:
    """Wait while some workers run and every failed one stopped on a configuration error.

    ``pcontext``: torch's process context for the local workers (its
    ``subprocess_handlers`` and ``error_files``); anything else is left alone.
    """
    handlers = getattr(pcontext, "subprocess_handlers", None)
    error_files = getattr(pcontext, "error_files", None)
    if not isinstance(handlers, dict) or not isinstance(error_files, dict):
        return
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        codes = {rank: handler.proc.poll() for rank, handler in handlers.items()}
        failed = [rank for rank, code in codes.items() if code not in (None, 0)]
        running = [rank for rank, code in codes.items() if code is None]
        if not failed or not running:
            return
        if not all(is_configuration_error(error_files.get(rank)) for rank in failed):
            return
        time.sleep(0.05)


def is_configuration_error(error_file: str | None) -> bool:
    """Whether the worker's torch error file records a :class:`UsageError`."""
    if not error_file:
        return False
    try:
        with open(error_file) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return False
    message = record.get("message") if isinstance(record, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return isinstance(message, str) and message.startswith(USAGE_PREFIX)
