"""The agree step: before a collective starts, every rank checks the others make the same call.

Horovod's coordinator matches every collective by name across ranks, so a
rank that sends a different shape gets "Mismatched allreduce tensor shapes".
NCCL and gloo do not: different shapes hang or mix data. Here every explicit
collective first runs manygpu's cross-rank check (:mod:`manygpu.comm.debug`:
operation, dtype, shape, call number and a digest of the name and arguments;
with ``MANYGPU_DEBUG=strict`` the name, or for an unnamed call its
``file:line``, as the call site); when it fails, the ranks exchange what each
was calling, as JSON (never pickle: nothing a rank sends is executed), and
the error lists them (:mod:`manygpu.horovod.reports`).

On the whole job, :func:`agree` first meets the other ranks
(:mod:`manygpu.horovod.matching`: named calls every rank has made start
before it), and when the check's table shows ranks in ``hvd.join()`` hands
over to :mod:`manygpu.horovod.joining`; in a process set it compares the
set's ranks over its sub-group. It keeps no state of its own: call numbers
are :mod:`manygpu.horovod.reports`'.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from manygpu.comm import debug as dbg
from manygpu.comm.common import active, all_gather_single, scratch_device, wait
from manygpu.comm.debug import CollectiveMismatchError
from manygpu.comm.objects import all_gather_json
from manygpu.errors import CollectiveTimeoutError
from manygpu.horovod.basics import Scope, session
from manygpu.horovod.joining import joined_ranks, refuse_in_set, with_joined
from manygpu.horovod.matching import Point, meet
from manygpu.horovod.reports import (
    Entry,
    HorovodMismatchError,
    named_stall,
    next_call,
    parse_row,
    render_mismatch,
)


def agree(
    op: str,
    tensor: torch.Tensor | None,
    *,
    key: object,
    desc: str,
    shape: tuple[int, ...] | None = None,
    details: list[Entry] | None = None,
    name: str | None = None,
    scope: Scope | None = None,
    shadow: Callable[[], dict[str, Any]] | None = None,
) -> int:
    """Before a collective: check every rank calls the same one; this rank's call number.

    Args:
        op: the collective, as :mod:`manygpu.comm.debug` names it.
        tensor: its tensor (dtype and shape compared), or ``None``.
        key: what else must agree (name, reduce op, root...); compared as a digest.
        desc: how this rank's call is shown in errors.
        shape: the shape to compare instead, with ``dbg.ANY`` where ranks may differ.
        details: a layout (many tensors) to list differences of, when they disagree.
        name: the user's name for the call: in strict debug mode the call site
            compared, instead of the line it was called from (as Horovod matches names).
        scope: the process set it runs in (``None``: the whole job); only its
            ranks are compared.
        shadow: what ranks in ``hvd.join()`` do instead (:func:`~manygpu.horovod.joining.
            zeros_spec`, ``BARRIER``); ``None``: the call is refused while a rank has joined.
    """
    if scope is not None and not scope.whole:
        return _agree_in_set(scope, op, tensor, key=key, desc=desc, shape=shape, details=details)
    if active():
        meet(Point.COLLECTIVE, desc)  # named calls every rank has made start first (matching.py)
    seq = next_call()
    if not active():
        return seq
    digest = zlib.crc32(repr(key).encode()) & 0x7FFFFFFF
    site = None if name is None else f"named {name!r}"
    timeout_s = session().timeout_s
    try:
        table = dbg.gather_calls(
            op, tensor, timeout_s=timeout_s, shape=shape, extra=digest, site=site
        )
        if not table.joined():
            dbg.compare_calls(table, timeout_s=timeout_s)
    except CollectiveMismatchError as exc:
        # Every rank saw the same table and raises here: a collective is safe.
        what = f"{desc}: comparing calls"
        sent = all_gather_json([desc, details], operation=what, timeout_s=timeout_s)
        rows = [parse_row(row, sender=r, operation=desc) for r, row in enumerate(sent)]
        raise HorovodMismatchError(render_mismatch(rows, str(exc))) from None
    except CollectiveTimeoutError as exc:
        named = named_stall(exc, seq, desc)
        if named is None:
            raise
        raise named from exc
    if table.joined():  # some ranks are in hvd.join(): they stand in, or every caller raises
        with_joined(table, shadow, desc, timeout_s)
    return seq


def _agree_in_set(
    scope: Scope,
    op: str,
    tensor: torch.Tensor | None,
    *,
    key: object,
    desc: str,
    shape: tuple[int, ...] | None,
    details: list[Entry] | None,
) -> int:
    """:func:`agree` among a process set's ranks: one small all-gather of integers over
    its sub-group (operation, dtype, shape, arguments, call number), the job's
    debug check being over every rank."""
    joined = joined_ranks()
    if joined:  # its joined ranks wait in the whole job's rounds, not here
        refuse_in_set(joined, desc + scope.label())
    seq = next_call(scope)
    if not active():
        return seq
    dims = list(shape if shape is not None else (tensor.shape if tensor is not None else ()))
    dtype = str(tensor.dtype) if tensor is not None else ""
    head = [zlib.crc32(op.encode()), zlib.crc32(dtype.encode()), len(dims), seq]
    head.append(zlib.crc32(repr(key).encode()) & 0x7FFFFFFF)
    row = torch.tensor(head + (dims + [-1] * 8)[:8], dtype=torch.int64, device=scratch_device())
    table = row.new_empty((scope.size, row.numel()))
    timeout_s = session().timeout_s
    try:
        work = all_gather_single(table, row.unsqueeze(0), group=scope.group, async_op=True)
        wait(work, f"{desc}: comparing calls", timeout_s)
    except CollectiveTimeoutError as exc:
        raise named_stall(exc, seq, desc, scope) or exc from exc
    if len({tuple(r) for r in table.tolist()}) == 1:
        return seq
    what = f"{desc}: comparing calls"
    sent = all_gather_json([desc, details], operation=what, timeout_s=timeout_s, group=scope.group)
    rows = [parse_row(row, sender=r, operation=desc) for r, row in enumerate(sent)]
    fallback = f"{desc}: the ranks of the set are at different call numbers{scope.label()}"
    text = render_mismatch(rows, fallback, ranks=scope.ranks)
    raise HorovodMismatchError(text + scope.label())
