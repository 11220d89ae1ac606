"""How a tensor travels: a dtype the backend lacks is carried in one that holds it exactly.

Horovod takes int16 (and the other integer widths) on CPU. gloo has no int16,
uint16, uint32 or uint64 for any collective (measured with torch 2.13 on two
gloo ranks: allreduce, broadcast, allgather, alltoall and reduce-scatter all
fail with "Invalid scalar type"). So such a tensor travels as a wider dtype
that holds every value exactly (int16 and uint16 as int32, uint32 as int64)
and is cast back when it arrives; sums and products that overflow wrap on the
way back as they would in the narrow type. uint64 has no wider integer: it
moves bit for bit as int64, which is exact for broadcast, allgather and
alltoall but not for reductions, so those are refused. A CPU tensor of a
dtype neither gloo nor this table handles (float8, complex32, ...) is refused
at once, naming the dtype, rather than failing later as a collective that
"did not complete". CUDA tensors get the same table (NCCL lacks int16 too)
and are otherwise left to NCCL.
"""

from __future__ import annotations

import torch

from manygpu.errors import UsageError

GLOO_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
"""Dtypes gloo moves and reduces itself (measured, see the module docstring)."""

_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
"""Carried as a wider integer: every value exact, reductions too."""

_SAME_BITS = {torch.uint64: torch.int64}
"""Carried bit for bit as a same-width dtype: exact for moving data only."""


def wire_dtype(dtype: torch.dtype, device: torch.device, what: str, *, reduce: bool) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as; one clear error when it cannot.

    Args:
        dtype: the user's tensor's dtype.
        device: where it lives (CPU tensors go over gloo).
        what: the operation, for the error (``allgather``).
        reduce: whether the values are combined (sum, min...), not only moved.
    """
    if dtype in _WIDER:
        return _WIDER[dtype]
    if dtype in _SAME_BITS:
        if reduce:
            raise UsageError(
                f"{what} of a {_name(dtype)} tensor is not supported (no wider integer "
                f"holds its values); cast it to torch.int64 or torch.float64 first"
            )
        return _SAME_BITS[dtype]
    if device.type == "cpu" and dtype not in GLOO_DTYPES:
        supported = ", ".join(sorted(_name(d) for d in GLOO_DTYPES | set(_WIDER)))
        raise UsageError(
            f"{what} of a {_name(dtype)} tensor is not supported on CPU (gloo); "
            f"cast it to one of: {supported}"
        )
    return dtype


def to_wire(tensor: torch.Tensor, what: str, *, reduce: bool = False) -> torch.Tensor:
    """``tensor`` as it travels: itself (same storage) when its dtype needs no carrying."""
    dtype = wire_dtype(tensor.dtype, tensor.device, what, reduce=reduce)
    if dtype == tensor.dtype:
        return tensor
    if tensor.dtype in _SAME_BITS:
        return tensor.view(dtype)
    return tensor.to(dtype)


def from_wire(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What arrived, back in the user's ``dtype`` (itself when it travelled as is)."""
    if wire.dtype == dtype:
        return wire
    if dtype in _SAME_BITS:
        return wire.view(dtype)
    return wire.to(dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
