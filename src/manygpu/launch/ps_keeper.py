"""Under ``--ps K``, a worker killed by a signal must not end the job: its servers decide.

torch's elastic agent stops every worker as soon as one fails. Asynchronous
parameter-server training is meant to outlive a lost worker (the servers drop
it and the others go on), so under ``manygpu launch --ps K`` each worker rank
(rank >= K) runs its script in a child process and stays as its *keeper*:

- the child exits normally or with an error: the keeper exits the same way
  (an exception in the script is a bug, and ends the job as usual);
- the child is killed by a signal (kill -9, the OOM killer): the keeper says
  so in one line and exits 0. The servers notice the lost link: in ``async``
  mode they drop the worker and training goes on; in ``sync`` mode they stop
  with an error that names it, which ends the job;
- the keeper is stopped (the agent's SIGTERM): it passes the signal on, and
  dies by the same signal once the child is gone, as if it were the child.

Servers (ranks < K) run their script directly: a dead server ends the job.
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
    """Whether this process is a parameter-server worker under ``--ps K`` (on Linux)."""
    servers = envmod.ps_servers(env)
    rank = envmod.get_int(env, "RANK")
    return sys.platform.startswith("linux") and servers is not None and (rank or 0) >= servers


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
        f"manygpu: rank {rank} (a parameter-server worker) was killed by "
        f"{signal.Signals(sig).name}; its servers decide: asynchronous training goes on "
        "without it, synchronous training ends",
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
