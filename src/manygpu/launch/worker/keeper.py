"""An expendable rank killed by a signal must not end the job: its peers decide.

torch's elastic agent stops every worker as soon as one fails. Some jobs are
meant to outlive a lost rank (asynchronous parameter servers drop a dead
worker and go on), so a rank the launcher marks expendable
(``MANYGPU_EXPENDABLE_FROM``: ``manygpu launch --ps K`` marks the workers,
ranks >= K) runs its script in a child process and stays as its *keeper*:

- the child exits normally or with an error: the keeper exits the same way
  (an exception in the script is a bug, and ends the job as usual);
- the child is killed by a signal (kill -9, the OOM killer): the keeper says
  so in one line and exits 0. The ranks it worked with notice the lost link
  and decide (parameter servers: ``async`` drops the worker and goes on,
  ``sync`` stops with an error that names it, which ends the job);
- the keeper is stopped (the agent's SIGTERM): it passes the signal on, and
  dies by the same signal once the child is gone, as if it were the child.

Other ranks run their script directly: their death ends the job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from manygpu.runtime import env as envmod

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def applies(env: envmod.Environ) -> bool:
    """Whether this process is an expendable rank (on Linux)."""
    first = envmod.expendable_from(env)
    rank = envmod.get_int(env, "RANK")
    return sys.platform.startswith("linux") and first is not None and (rank or 0) >= first


def keep() -> None:
    """Fork: the child returns and runs the script; this process waits and never returns."""
    pid = os.fork()
    if pid == 0:
        _die_with_keeper()
        return
    stopped: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stopped.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    _, status = os.waitpid(pid, 0)  # retried by Python when a forwarded signal interrupts it
    os._exit(_outcome(status, stopped, envmod.get_int(envmod.current(), "RANK") or 0))


def _outcome(status: int, stopped: list[int], rank: int) -> int:
    """The keeper's exit code for the child's wait ``status`` (or dies by its signal)."""
    if not os.WIFSIGNALED(status):
        return os.waitstatus_to_exitcode(status)
    sig = os.WTERMSIG(status)
    if stopped or sig in (signal.SIGTERM, signal.SIGINT):
        # Stopped from outside: end like the child did, so the launcher sees a stop.
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    print(
        f"manygpu: rank {rank} (expendable in this job) was killed by "
        f"{signal.Signals(sig).name}; the ranks it worked with decide whether the job "
        "goes on without it",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _die_with_keeper() -> None:
    """The child gets SIGKILL when its keeper dies, so it is never orphaned."""
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)
