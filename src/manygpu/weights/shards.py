"""A rank's own part of a tensor: which block of the whole it holds, filled in place.

A DTensor whose placements are all ``Shard`` / ``Replicate`` holds one
contiguous block of the global tensor on each rank: its offset and shape come
from torch's own rule (``compute_local_shape_and_global_offset``, which DCP uses
too), so the block is read alone. Under FSDP2 over tensor parallelism the dp
dimension is a ``_StridedShard``: the local part is several interleaved pieces,
so that one parameter is read whole and its local part taken by
``distribute_tensor(..., src_data_rank=None)`` (no communication; one
parameter in flight). Plain tensors (replicated strategies) are read whole.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeGuard

import torch

from manygpu.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Reader = Callable[[tuple[slice, ...] | None], torch.Tensor]
"""Reads a block of one stored tensor (None: all of it), on CPU."""


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor, without importing DTensor (with sympy, ~1 CPU-s
    of every process that builds a Parallel): none exists before its module loads."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _one_block(placement: object) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    if type(placement).__name__ == "_StridedShard":  # not a Shard subclass today; keep it so
        return False
    return isinstance(placement, Shard | Replicate)


def local_block(tensor: DTensor) -> tuple[slice, ...] | None:
    """The global slice ``tensor``'s local part is, or None when it is not one block."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(_one_block(p) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor`` (its local part for a DTensor)."""
    return nbytes(tensor.to_local() if is_dtensor(tensor) else tensor)


def fill_one(target: torch.Tensor, read: Reader) -> int:
    """Copy the stored tensor into ``target`` in place (its own part for a DTensor),
    cast to ``target``'s dtype, on ``target``'s device; returns the bytes read."""
    with torch.no_grad():
        if not is_dtensor(target):
            data = read(None)
            target.copy_(data)
            return nbytes(data)
        if any(p.is_partial() for p in target.placements):
            raise CheckpointError(
                f"a parameter placed as {target.placements} holds partial sums, not values; "
                "load weights into a model whose parameters are sharded or replicated"
            )
        local = target.to_local()
        block = local_block(target)
        if block is None:
            from torch.distributed.tensor import distribute_tensor

            full = read(None)
            part = distribute_tensor(
                full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
            )
            local.copy_(part.to_local())
            return nbytes(full)
        want = tuple(s.stop - s.start for s in block)
        if tuple(local.shape) != want:
            raise CheckpointError(
                f"a DTensor's local part is {tuple(local.shape)}, not the {want} its "
                f"placements {target.placements} give; it cannot be loaded block by block"
            )
        if local.numel() == 0:  # more ranks than rows: nothing of it here
            return 0
        data = read(block)
        local.copy_(data)
        return nbytes(data)


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor`` (collective for a DTensor: every rank calls it in order).

    With CPU offload the local part is on the host while the mesh is on a device;
    the all-gather runs on the mesh's device, so the part goes there first.
    """
    if not is_dtensor(tensor):
        return tensor.detach()
    with torch.no_grad():
        local = tensor.to_local()
        mesh = tensor.device_mesh
        if local.device.type != mesh.device_type:
            from torch.distributed.tensor import DTensor

            tensor = DTensor.from_local(
                local.to(mesh.device_type),
                mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        return tensor.full_tensor()


def copy_part(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target``'s values from ``source`` laid out the same way (both plain, or both
    DTensors of one mesh and placements); anything else is refused."""
    with torch.no_grad():
        if not is_dtensor(target) and not is_dtensor(source):
            target.copy_(source)
            return
        same = (
            is_dtensor(target)
            and is_dtensor(source)
            and target.device_mesh == source.device_mesh
            and target.placements == source.placements
        )
        if not same:
            raise CheckpointError(
                "one stored tensor fills two tensors of this rank laid out differently; "
                "load from safetensors (manygpu checkpoint export) instead"
            )
        assert is_dtensor(target) and is_dtensor(source)
        target.to_local().copy_(source.to_local())
