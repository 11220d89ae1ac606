"""Preemption: a SIGTERM, SIGUSR1 or a first Ctrl-C means "save at the next step boundary,
then stop" (a second Ctrl-C stops at once).

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM some time before
they kill a job; Slurm sends the signal a job asked for (``--signal=USR1@N``)
N seconds before its time limit. The handler only records the notice; the
training thread acts on it at a step boundary, where the state is consistent,
after every rank has agreed that some rank was told (ranks may see the signal
at different steps).
Saving is the checkpointer's business; this module owns the signal, the
agreement, the Slurm requeue and the exit.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import torch

from manygpu import comm
from manygpu.runtime import env as envmod
from manygpu.runtime import notice


class PreemptionNotice:
    """What this process's notice was, once every rank has reached a step boundary.

    The signal itself is recorded process-wide (:mod:`manygpu.runtime.notice`):
    SIGTERM, or SIGUSR1 (Slurm's ``--signal=USR1@N`` warning before the time limit).
    """

    def listen(self) -> None:
        """Handle SIGTERM, SIGUSR1 and a first Ctrl-C from now on (main thread only)."""
        notice.listen()

    def agreed(self, *, device: torch.device, world_size: int, timeout_s: float) -> int | None:
        """The notice some rank received (collective: every rank calls it), or ``None``.

        A warning (SIGUSR1) outranks SIGTERM: it asks for a requeue under Slurm.
        """
        code = _CODES.get(notice.received() or 0, 0)
        flag = torch.tensor([code], device=device)
        if world_size > 1:  # ranks may see the signal at different steps
            comm.all_reduce(flag, "max", timeout_s=timeout_s)
        return _SIGNALS.get(int(flag.item()))


_CODES = {int(signal.SIGINT): 1, int(signal.SIGTERM): 2, int(notice.WARNING): 3}
_SIGNALS = {v: k for k, v in _CODES.items()}


def wants_requeue(requeue: bool | None, signum: int, env: envmod.Environ) -> bool:
    """Whether to ``scontrol requeue``: as asked, else (``None``) under Slurm on its
    warning signal (``--signal=USR1@N``: the time limit is near, the work is not done).
    SIGTERM alone does not: ``scancel`` means stop, and Slurm requeues by itself
    after its own preemption or ``scontrol requeue``."""
    if requeue is not None:
        return requeue
    return signum == notice.WARNING and bool(envmod.get_str(env, "SLURM_JOB_ID"))


def requeue_slurm_job() -> None:
    """Put this Slurm job back in the queue (nothing outside Slurm)."""
    job = envmod.get_str(envmod.current(), "SLURM_JOB_ID")
    if not job:
        return
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"manygpu: scontrol requeue {job} failed: {exc}", file=sys.stderr)
        return
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        print(
            f"manygpu: scontrol requeue {job} failed: {why[-1]} (a job submitted with "
            "--no-requeue, or JobRequeue=0 in slurm.conf, cannot be requeued)",
            file=sys.stderr,
        )


def exit_now(code: int) -> None:
    """Exit at once after flushing: a preempted job must not risk the C++ teardown
    of backend threads (seen to abort with SIGABRT) turning a clean stop into a crash."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
