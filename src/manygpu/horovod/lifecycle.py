"""``hvd.init``: the job's session first, then its process sets.

Kept apart from :mod:`manygpu.horovod.basics` (the session every module reads)
because registering a process set is a call of its own: it is checked across
ranks like any collective (:mod:`manygpu.horovod.process_sets`, then
:mod:`manygpu.horovod.checks`), so ``init`` stands above the whole call path
instead of the session calling back up into it.
"""

from __future__ import annotations

import atexit
from typing import Any

from manygpu.errors import UsageError
from manygpu.horovod import process_sets as _sets
from manygpu.horovod.basics import is_initialized, open_session, shutdown

_exit_hook = False


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job the launcher started (a second call does nothing, as in Horovod).

    Args:
        comm: Horovod's MPI communicator or rank list: not supported; start
            only the processes you want instead.
        process_sets: ``hvd.ProcessSet`` objects to register, in order (ids 1, 2, ...),
            or ``"dynamic"`` to allow ``hvd.add_process_set`` later.
    """
    global _exit_hook
    if comm is not None:
        raise UsageError(
            "hvd.init(comm=...) is not supported: manygpu.horovod joins every process the "
            "launcher started; start only the ones you want (manygpu launch -np N), or use "
            "torch.distributed.new_group(ranks) for a subgroup"
        )
    if is_initialized():
        return
    open_session()
    try:
        _sets.setup(process_sets)
    except BaseException:
        shutdown()  # a bad process set leaves no half-initialized job behind
        raise
    if not _exit_hook:
        atexit.register(shutdown)  # Horovod shuts down at exit too
        _exit_hook = True
