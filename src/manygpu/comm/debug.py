"""Debug mode: check that every rank calls the same collective, before calling it.

A rank that calls ``all_reduce`` on 4 floats while another calls it on 8, or
calls ``all_gather`` instead, makes NCCL/gloo hang or silently mix data. In
debug mode each collective first all-gathers a small fingerprint (operation,
dtype, shape, the call's number on this rank and where in the user's code it
was made) and raises :class:`CollectiveMismatchError` naming the ranks that
differ. The number and the call site catch what shapes cannot: a rank that
skips a call (its next call, from another line, meets the others' skipped
one) or makes an extra one (at :func:`check_end` the others are done). It
costs one tiny all-gather per call: for finding bugs, not production.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections import Counter

import torch
import torch.distributed as dist

from manygpu.comm.common import all_gather_single, scratch_device, wait
from manygpu.errors import ManyGPUError

_WIDTH = 15  # op, dtype, ndim, 8 dims, extra, call number, file hash, line
_MAX_DIMS = 8
_SEQ, _FILE, _LINE = 12, 13, 14
_calls: dict[int, int] = {}
"""Collectives checked so far, per process group (keyed by the group object's id)."""
ANY = -2
"""A dimension that may differ between ranks (e.g. dim 0 of an uneven all-gather)."""

_OPS = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_uneven",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "end of the job",
]
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


class CollectiveMismatchError(ManyGPUError, RuntimeError):
    """Ranks called different collectives (or the same one on different shapes)."""


def _call_site() -> tuple[str, int]:
    """The first frame outside manygpu (and torch): where the user made this call."""
    frame = sys._getframe(1)
    package = os.path.dirname(os.path.dirname(__file__))
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(package) and "/torch/" not in name:
            return name, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "?", -1


def _fingerprint(
    op: str, tensor: torch.Tensor | None, shape: tuple[int, ...] | None, extra: int, seq: int
) -> torch.Tensor:
    row = torch.full((_WIDTH,), -1, dtype=torch.int64)
    row[0] = _OPS.index(op)
    if tensor is not None:
        dims = shape if shape is not None else tuple(tensor.shape)
        if len(dims) > _MAX_DIMS:
            dims = (*dims[: _MAX_DIMS - 1], -3)
        row[1] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 99
        row[2] = len(tensor.shape)
        row[3 : 3 + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    row[11] = extra
    file, line = _call_site()
    row[_SEQ] = seq
    row[_FILE] = zlib.crc32(os.path.basename(file).encode())
    row[_LINE] = line
    return row


def _render(row: list[int]) -> str:
    op = _OPS[row[0]] if 0 <= row[0] < len(_OPS) else "?"
    where = f" at line {row[_LINE]} as call #{row[_SEQ]}" if row[_LINE] >= 0 else ""
    if row[1] < 0:
        return (
            f"{op}{where}"
            if row[0] != _OPS.index("end of the job")
            else (f"{op} after {row[_SEQ] - 1} calls")
        )
    dtype = str(_DTYPES[row[1]]).removeprefix("torch.") if row[1] < len(_DTYPES) else "?"
    dims = ["*" if d == ANY else str(d) for d in row[3 : 3 + row[2]]]
    extra = f", arg={row[11]}" if row[11] >= 0 else ""
    return f"{op}({dtype}[{'x'.join(dims) or 'scalar'}]{extra}){where}"


def check_same_call(
    op: str,
    tensor: torch.Tensor | None,
    *,
    timeout_s: float,
    shape: tuple[int, ...] | None = None,
    extra: int = -1,
) -> None:
    """Raise on every rank if any rank is about to call something else.

    Args:
        op: the collective's name.
        tensor: its tensor (dtype and shape are compared).
        shape: the shape to compare instead, with :data:`ANY` for free dimensions.
        extra: an argument that must agree (reduce op, root rank), -1 for none.
    """
    key = id(dist.group.WORLD)
    _calls[key] = seq = _calls.get(key, 0) + 1
    row = _fingerprint(op, tensor, shape, extra, seq).to(scratch_device())
    world = dist.get_world_size()
    table = torch.empty((world, _WIDTH), dtype=torch.int64, device=row.device)
    work = all_gather_single(table, row.unsqueeze(0), async_op=True)
    wait(work, f"debug check before {op}", timeout_s)
    full = [tuple(r) for r in table.cpu().tolist()]
    # The call site is shown, not compared: ranks may reach one collective from
    # different lines (if rank == 0: ... else: ...). Operation, shape and the
    # call's number must agree.
    rows = [r[:_FILE] for r in full]
    if len(set(rows)) == 1:
        return
    common, _ = Counter(rows).most_common(1)[0]
    odd = [r for r, row_r in enumerate(rows) if row_r != common]
    first = next(r for r in range(world) if r not in odd)
    calls = "; ".join(f"rank {r} calls {_render(list(full[r]))}" for r in odd)
    majority = [r for r in range(world) if r not in odd]
    raise CollectiveMismatchError(
        f"rank {dist.get_rank()}: collective mismatch: ranks {majority} call "
        f"{_render(list(full[first]))}, but {calls}; every rank must run the same "
        "collectives with the same shapes and dtypes in the same order (a rank that "
        "skipped or added a call is the one whose call numbers differ)"
    )


def check_end(*, timeout_s: float) -> None:
    """At the end of a job: every rank must have made the same number of calls.

    A rank with an extra call is still waiting in that call's check, which
    meets this one and names it; a rank that skipped one arrives here early.
    """
    check_same_call("end of the job", None, timeout_s=timeout_s)
