"""The whole model's gradient norm, whatever holds which piece of the gradients.

``torch.nn.utils.clip_grad_norm_`` sees only this process's tensors: under a
pipeline it clips by one stage's norm, and it refuses a mix of plain tensors
and DTensors (tensor parallel keeps norms and embeddings replicated) or
DTensors on different meshes (dp x tp). Here each gradient says what it is:

- a DTensor's local piece counts once per mesh dimension it is *sharded* on
  (summed over that dimension's group) and once in all for replicated ones;
- a plain tensor is whole on this rank (replicated, as under DDP), unless it
  carries a group in its :data:`HELD_OVER` attribute: then each rank of that
  group holds different tensors of this kind (expert parallelism's experts
  kept one module per expert), and their pieces are summed over it too;
- ``across`` names a group whose ranks hold *different* tensors (pipeline
  stages): their contributions are summed over it last.

The result is a plain tensor, equal on every rank, equal to one process's norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from manygpu.comm.common import describe, wait

HELD_OVER = "_manygpu_norm_held_over"
"""A parameter's attribute: the group whose ranks hold different tensors of its kind."""


def _power(local: torch.Tensor, p: float, device: torch.device) -> torch.Tensor:
    """sum(|g|^p) of one piece (max(|g|) for p=inf), in fp32 on ``device``."""
    norm = torch.linalg.vector_norm(local.detach().float(), p)
    return (norm if math.isinf(p) else norm**p).to(device)


def _combine(a: torch.Tensor, b: torch.Tensor, p: float) -> torch.Tensor:
    return torch.maximum(a, b) if math.isinf(p) else a + b


def _reduce(value: torch.Tensor, p: float, group: Any, timeout_s: float) -> torch.Tensor:
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    work = dist.all_reduce(value, op=op, group=group, async_op=True)
    wait(work, describe("gradient-norm all-reduce", value), timeout_s)
    return value


def _whole_partials(grad: Any) -> Any:
    from torch.distributed.tensor import Replicate

    # A Partial gradient holds addends, whose norm is not the sum's: sum them first.
    if any(pl.is_partial() for pl in grad.placements):
        placements = [Replicate() if pl.is_partial() else pl for pl in grad.placements]
        return grad.redistribute(grad.device_mesh, placements)
    return grad


@torch.no_grad()
def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    device: torch.device,
    across: Any = None,
    timeout_s: float = 180.0,
) -> torch.Tensor:
    """The p-norm of all gradients of ``parameters`` as if they lived in one process.

    Every rank of the job must call it (it runs collectives over the groups
    the gradients are sharded on, and over ``across``).
    """
    from torch.distributed.tensor import DTensor  # imported on use: keeps import manygpu light

    p = float(norm_type)
    total = torch.zeros((), device=device)
    sharded: dict[tuple[int, tuple[int, ...], int], tuple[list[Any], torch.Tensor]] = {}
    for param in parameters:
        held = getattr(param, HELD_OVER, None)
        if held is not None and (0, (), id(held)) not in sharded:
            # Made on the first such parameter, gradient or not, so every rank reduces it.
            sharded[(0, (), id(held))] = ([held], torch.zeros((), device=device))
        grad = param.grad
        if grad is None:
            continue
        if not isinstance(grad, DTensor):
            if held is None:
                total = _combine(total, _power(grad, p, device), p)
            else:
                over, sum_held = sharded[(0, (), id(held))]
                sharded[(0, (), id(held))] = (over, _combine(sum_held, _power(grad, p, device), p))
            continue
        grad = _whole_partials(grad)
        # Not ``is_shard()``: FSDP2 over a dimension already sharded (experts over ep, then
        # fsdp) places a _StridedShard, which is no Shard but splits the tensor all the same.
        dims = tuple(i for i, pl in enumerate(grad.placements) if not pl.is_replicate())
        key = (id(grad.device_mesh), dims, 0)
        groups, value = sharded.get(key, ([grad.device_mesh.get_group(i) for i in dims], None))
        piece = _power(grad.to_local(), p, device)
        sharded[key] = (groups, piece if value is None else _combine(value, piece, p))
    # Fixed order on every rank: the dict is filled in parameter order, same everywhere.
    for groups, value in sharded.values():
        for group in groups:
            value = _reduce(value, p, group, timeout_s)
        total = _combine(total, value, p)
    if across is not None and dist.is_initialized():
        total = _reduce(total, p, across, timeout_s)
    return total if math.isinf(p) else total ** (1.0 / p)


@torch.no_grad()
def clip_grads_(parameters: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / norm)``, as torch's clipping does."""
    from torch.distributed.tensor import DTensor

    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.device, local.dtype))
