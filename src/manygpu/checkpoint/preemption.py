"""Preemption: a SIGTERM means "save at the next step boundary, then stop".

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM some time before
they kill a job. The handler only records the notice; the training thread acts
on it at a step boundary, where the state is consistent, after every rank has
agreed that some rank was told (ranks may see the signal at different steps).
Saving is the checkpointer's business; this module owns the signal, the
agreement, the Slurm requeue and the exit.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

import torch

from manygpu import comm
from manygpu.runtime import env as envmod


class PreemptionNotice:
    """Remembers a SIGTERM until the loop reaches a step boundary."""

    def __init__(self) -> None:
        self._received = False

    def listen(self) -> None:
        """Handle SIGTERM from now on (only the main thread may install handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # Restart interrupted system calls: a gloo/NCCL thread blocked in recv
        # must not see EINTR (it would abort the process) just because a
        # preemption notice arrived.
        signal.siginterrupt(signal.SIGTERM, False)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self._received = True

    def agreed(self, *, device: torch.device, world_size: int, timeout_s: float) -> bool:
        """Whether any rank has received the notice (collective: every rank calls it)."""
        flag = torch.tensor([1 if self._received else 0], device=device)
        if world_size > 1:  # ranks may see the signal at different steps
            comm.all_reduce(flag, "max", timeout_s=timeout_s)
        return bool(flag.item())


def requeue_slurm_job() -> None:
    """Put this Slurm job back in the queue (nothing outside Slurm)."""
    job = envmod.get_str(envmod.current(), "SLURM_JOB_ID")
    if job:
        subprocess.run(["scontrol", "requeue", job], check=False, timeout=30)


def exit_now(code: int) -> None:
    """Exit at once after flushing: a preempted job must not risk the C++ teardown
    of backend threads (seen to abort with SIGABRT) turning a clean stop into a crash."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
