"""Make every rank's copy of a module equal to rank 0's, before any strategy wraps it.

Why here and not in each strategy: ``Parallel`` seeds each rank differently (so
dropout and augmentation differ per data shard), so a model built after it
starts from different weights on each rank. DDP would hide that by
broadcasting at construction, but FSDP would shard a patchwork of different
initialisations, and replicas under HSDP, dp x tp or pipeline x dp would stay
different for the whole run (gradients are averaged, weights never are).
One broadcast of the unwrapped model, before wrapping, fixes all of them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from manygpu.comm.common import active, describe, wait

_BUCKET_BYTES = 256 * 2**20  # bounded extra memory for the flat copies


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers, each once (tied weights appear once), meta tensors left out."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen or tensor.is_meta:
            continue
        seen.add(id(tensor))
        out.append(tensor)
    return out


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Same-dtype groups of at most ``_BUCKET_BYTES`` (one large tensor is its own)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > _BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


@torch.no_grad()
def broadcast_module_state(
    module: nn.Module, *, device: torch.device, timeout_s: float, src: int = 0
) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module``, in place.

    Tensors travel through ``device`` (NCCL takes CUDA tensors only) in flat
    buckets per dtype, so a model of many small tensors costs few collectives.
    Every rank must pass a module of the same structure.
    """
    if not active() or dist.get_world_size() == 1:
        return
    for bucket in _buckets(module_tensors(module)):
        flat = _flatten_dense_tensors([t.detach().to(device) for t in bucket])
        work = dist.broadcast(flat, src=src, async_op=True)
        wait(work, describe("broadcast of the initial model state", flat), timeout_s)
        for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            tensor.copy_(value)
