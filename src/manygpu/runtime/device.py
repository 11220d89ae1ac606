"""Device and backend choice, and CPU threads when processes share a CPU."""

from __future__ import annotations

import os
from typing import Any

import torch

from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime import ray_train
from manygpu.runtime.env import Environ

BACKENDS = ("nccl", "gloo", "mpi", "xccl", "ucc")


def cpu_count() -> int:
    """CPUs this process may run on (affinity-aware, unlike ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def choose_device(
    local_rank: int, requested: str | None = None, bound_per_task: bool = False
) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is there, else CPU; ``requested`` overrides.

    ``bound_per_task``: the scheduler gave each task its own GPUs (Slurm's
    ``--gpus-per-task`` / ``--gpu-bind``), so this process sees only its own.
    """
    if requested is not None:
        device = parse_device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"device {requested!r} asked for but CUDA is not available here")
        if device.type != "cuda" or device.index is not None:
            return device
    if torch.cuda.is_available():
        given = ray_train.device()  # Ray Train maps its workers to GPUs itself
        if given is not None:
            return given
        index = cuda_index(local_rank, torch.cuda.device_count(), bound_per_task)
        return torch.device("cuda", index)
    return torch.device("cpu")


DEVICE_CHOICES = '"cpu", "cuda" or "cuda:N" (N a GPU index)'
"""What to write for ``device``, in the words of the error that refuses a bad one."""


def parse_device(requested: str | torch.device) -> torch.device:
    """``requested`` as a torch device, or a one-line :class:`UsageError` naming the choices.

    torch's own refusal (``RuntimeError: Invalid device string: 'tpu9'``)
    names no valid choice and surfaces from deep inside ``Parallel``; a typo
    here should read as the user's to fix. Types torch knows beyond CPU and
    CUDA (``xpu``, ``mps``) pass, as torch accepts them.
    """
    if not isinstance(requested, str | torch.device):
        raise UsageError(f"device takes a string: {DEVICE_CHOICES}; got {requested!r}")
    try:
        return torch.device(requested)
    except RuntimeError:
        raise UsageError(
            f"device {requested!r} is not a device; use {DEVICE_CHOICES}, "
            "or leave it unset for cuda:LOCAL_RANK (else the CPU)"
        ) from None


def cuda_index(local_rank: int, visible: int, bound_per_task: bool) -> int:
    """Which visible GPU is this process's.

    Normally its local rank's. A task Slurm bound to one GPU sees only that one,
    as GPU 0, whatever its local rank: ``cuda:LOCAL_RANK`` would not exist.
    """
    if bound_per_task and visible == 1:
        return 0
    if local_rank >= visible:
        bound = " (Slurm bound GPUs to tasks: give each task one, --gpus-per-task=1)"
        raise UsageError(
            f"local rank {local_rank} has no GPU: this node runs more processes than its "
            f"{visible} visible GPU(s); use --nproc-per-node {visible} or fewer"
            + (bound if bound_per_task else "")
        )
    return local_rank


def choose_backend(device: torch.device, requested: str | None = None) -> str:
    """NCCL for CUDA, gloo for CPU, unless the user asked for one."""
    if requested is not None:
        if requested not in BACKENDS:
            raise UsageError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
        if requested == "nccl" and device.type != "cuda":
            raise UsageError("backend 'nccl' needs CUDA devices; use 'gloo' on CPU")
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def threads_per_process(local_world_size: int, cpus: int | None = None) -> int:
    """Split the CPUs evenly among the processes of this node (at least 1)."""
    cpus = cpu_count() if cpus is None else cpus
    return max(1, cpus // max(local_world_size, 1))


def set_cpu_threads(local_world_size: int, env: Environ) -> int:
    """Avoid oversubscription: N processes x all cores threads thrash a CPU.

    Respects ``OMP_NUM_THREADS`` when the user set it. Returns the count in use.
    """
    if not envmod.user_set_threads(env):
        torch.set_num_threads(threads_per_process(local_world_size))
    return torch.get_num_threads()


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor inside (nested) tuples, lists and dicts to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch
