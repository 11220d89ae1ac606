"""torch's exit barrier: a failed node counts itself out, a waiting one hears signals.

Once its own workers succeed, torch's agent waits in an exit barrier until every
node's agent has arrived (``exit_barrier_timeout``, 300 s): the node that hosts
the job's store must outlive the workers that still use it. An agent whose
workers failed (no restarts left), or that was stopped by a signal (a hang
verdict, a scheduler), never arrives there, so the nodes that had finished wait
the whole 300 s: a job whose last rank crashed at exit held every other node,
and under Slurm its step and its GPUs, five more minutes. torch documents the
barrier as waiting for the agents "to finish executing their local workers
(either successfully or not)"; here a failed node says it has finished, once its
workers are stopped. The barrier still opens only when every node is done, so a
node whose workers still run keeps the store's host waiting, as before.

The wait itself is :func:`wait`: torch's is one blocking store call, during which
Python runs no signal handler, so a Ctrl-C or a scheduler's SIGTERM to a node
waiting there was acted on only when the barrier opened, up to 300 s later. Here
the node asks the store twice a second and sleeps between, where a signal ends
the wait at once.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.utils import store as store_util

PREFIX = agent_api._TERMINAL_STATE_SYNC_ID
"""The exit barrier's keys in the job's store: torch's own, so torch's agents and ours meet."""

POLL_S = 0.5
"""How often a node waiting at the exit barrier asks whether every node has arrived."""

COUNT_TIMEOUT_S = 5.0
"""How long one question to the store may take here: a store whose host is gone
has no one waiting on it, and no launcher should wait for it either."""


def count_out(store: Any, nodes: int, timeout_s: float = COUNT_TIMEOUT_S) -> bool:
    """Count this node as arrived at the exit barrier of ``store`` (a job of ``nodes``
    agents) without waiting for the others; whether the store took it."""
    try:
        _arrive(store, nodes, timeout_s)
    except (RuntimeError, OSError):  # the store's host is gone: nobody waits on it
        return False
    return True


def wait(store: Any, nodes: int, timeout_s: float, poll_s: float = POLL_S) -> bool:
    """Arrive at the exit barrier, then wait up to ``timeout_s`` for the ``nodes``
    agents of the job; whether all of them arrived. A signal's handler runs between
    two questions to the store (torch's agent raises its ``SignalException`` there)."""
    try:
        last = _arrive(store, nodes, COUNT_TIMEOUT_S)
        deadline = time.monotonic() + timeout_s
        while not store.check([last]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
    except (RuntimeError, OSError):  # the store's host has ended: no one is left to wait for
        return False
    return True


def _arrive(store: Any, nodes: int, timeout_s: float) -> str:
    """Count this node in, each question to the store bounded by ``timeout_s``; the key
    the last of the ``nodes`` to arrive sets."""
    store.set_timeout(timedelta(seconds=timeout_s))
    return str(store_util._barrier_nonblocking(store=store, world_size=nodes, key_prefix=PREFIX))
