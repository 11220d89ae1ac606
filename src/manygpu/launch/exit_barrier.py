"""A node whose workers failed still counts itself out of torch's exit barrier.

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
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.utils import store as store_util

COUNT_TIMEOUT_S = 5.0
"""How long counting out may wait for the store: a store whose host is gone has no
one waiting on it, and a failing launcher must not wait for it either."""


def count_out(store: Any, nodes: int, timeout_s: float = COUNT_TIMEOUT_S) -> bool:
    """Count this node as arrived at the exit barrier of ``store`` (a job of ``nodes``
    agents) without waiting for the others; whether the store took it."""
    try:
        store.set_timeout(timedelta(seconds=timeout_s))
        store_util._barrier_nonblocking(
            store=store, world_size=nodes, key_prefix=agent_api._TERMINAL_STATE_SYNC_ID
        )
    except (RuntimeError, OSError):  # the store's host is gone: nobody waits on it
        return False
    return True
