"""When some ranks are in ``hvd.join()``: what the others' calls ask of them, and who has joined.

Horovod's semantics: a rank that calls ``join()`` stops feeding data but keeps
taking part in what the ranks still training run, so ranks with uneven amounts
of data all finish. Its ``allreduce`` contribution is zeros (``Average`` still
divides by the whole job's size, as Horovod's does; ``Min``/``Max``/``Product``
see the zeros too), ``barrier`` counts it as arrived, and a
``DistributedOptimizer`` step on the others goes on (its gradient buckets get
zeros). ``allgather``, ``broadcast``, ``alltoall`` and ``reducescatter`` are
refused on the ranks that call them (:class:`JoinedRankError`, as Horovod's
"not supported with Join"). ``join()`` returns once every rank has joined,
with the rank that joined last, the same on every rank.

This module is the callers' side, the step of a call after matching: each
explicit collective begins with the cross-rank check, where a joined rank
sends a ``joined`` row (:mod:`manygpu.comm.debug`). Seeing such a row, the
ranks exchange what the joined ranks must do (as JSON: dtype, length and
reduce op of each all-reduce, never a pickle; :func:`zeros_spec`,
:data:`BARRIER`) and every rank decides alike from the same table: stand in,
refuse, or report a mismatch (:func:`with_joined`). Only the whole job is
covered: Horovod's ``join`` has no process set either, and process-set calls
are refused while a rank has joined (:func:`refuse_in_set`).

It owns the joins: the ranks in ``hvd.join()`` as of this rank's last round
(:func:`note_round`, told by :mod:`manygpu.horovod.matching` and by the joined
rank's own loop), and the whole job's DistributedOptimizers in the order built,
whose buckets a joined rank stands in for (:func:`register`). The joined
rank's side, ``hvd.join()`` itself, is :mod:`manygpu.horovod.stand_in`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from manygpu.comm import debug as dbg
from manygpu.comm.objects import all_gather_json
from manygpu.errors import UsageError
from manygpu.horovod.basics import owned
from manygpu.horovod.exceptions import HorovodInternalError
from manygpu.horovod.reports import HorovodMismatchError, render_mismatch
from manygpu.horovod.wire import wire_dtype
from manygpu.runtime.ranks import ranks_text

Spec = dict[str, Any]
"""What joined ranks do for a call, as it travels (JSON): ``{"zeros": [[device type,
dtype, length, reduce op], ...]}`` (one all-reduce each), ``{"barrier": 1}``, or, when
they do nothing and the callers raise, ``{"refuse": call}`` / ``{"error": text}``."""

BARRIER: Spec = {"barrier": 1}
REDUCE_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "PRODUCT": dist.ReduceOp.PRODUCT,
}
"""The reduce ops joined ranks can stand in for, by the name they travel under."""


class JoinedRankError(HorovodInternalError):
    """A collective that cannot run while some rank has joined (Horovod refuses it too)."""


# -- what a call asks of joined ranks ----------------------------------------------------
def zeros_spec(tensors: Sequence[torch.Tensor], op: object) -> Spec:
    """Joined ranks all-reduce zeros shaped as the flat tensors the callers send: one per
    (device, dtype), in first-seen order (as ``grouped_allreduce`` flattens them)."""
    name = next(k for k, v in REDUCE_OPS.items() if v == op)
    flats: dict[tuple[torch.device, torch.dtype], list[Any]] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        if key not in flats:
            wired = wire_dtype(t.dtype, t.device, "allreduce", reduce=True)
            flats[key] = [t.device.type, str(wired).removeprefix("torch."), 0, name]
        flats[key][2] += t.numel()
    return {"zeros": list(flats.values())}


def agreed(table: dbg.CallTable, sent: Sequence[Any]) -> Spec | None:
    """What joined ranks stand in for, or ``None`` when the callers raise instead.

    Alike on every rank: the same table and the same ``[desc, spec]`` rows.
    """
    joined = set(table.joined())
    live = [r for r in range(len(table.rows)) if r not in joined]
    specs = [sent[r][1] if isinstance(sent[r], list) and len(sent[r]) == 2 else None for r in live]
    first = specs[0] if specs else None
    if not (isinstance(first, dict) and ("zeros" in first or "barrier" in first)):
        return None
    if not table.same(live) or any(s != first for s in specs):
        return None
    return first


def with_joined(
    table: dbg.CallTable, shadow: Callable[[], Spec] | None, desc: str, timeout_s: float
) -> None:
    """A caller's collective while some ranks have joined: tell them what to stand in for,
    or raise (alike on every caller; the joined ranks then do nothing)."""
    try:
        spec = shadow() if shadow is not None else {"refuse": desc}
    except UsageError as exc:  # a dtype nothing carries: the callers raise it after the exchange
        spec = {"error": str(exc)}
    sent = all_gather_json(
        [desc, spec], operation=f"{desc}: with joined ranks", timeout_s=timeout_s
    )
    if agreed(table, sent) is not None:
        return
    me, joined = dist.get_rank(), table.joined()
    if "error" in spec:
        raise UsageError(spec["error"])
    if "refuse" in spec:
        raise JoinedRankError(
            f"rank {me}: {desc} is not supported while {ranks_text(joined)} "
            f"{'has' if len(joined) == 1 else 'have'} joined (hvd.join), as in Horovod: only "
            "allreduce (joined ranks add zeros) and barrier run then; make this call before "
            "any rank joins"
        )
    rows = [(str(row[0]) if isinstance(row, list) and row else "?", None) for row in sent]
    raise HorovodMismatchError(render_mismatch(rows, f"rank {me}: {desc}: ranks disagree"))


def refuse_in_set(joined: Sequence[int], desc: str) -> None:
    """A process-set call while some ranks have joined (as this rank's last round said):
    refused at once, where the set's joined ranks would leave it waiting until the timeout."""
    raise JoinedRankError(
        f"rank {dist.get_rank()}: {desc} is not supported while {ranks_text(joined)} "
        f"{'has' if len(joined) == 1 else 'have'} joined (hvd.join): a joined rank stands in "
        "only for calls on the whole job; make process-set calls before any rank joins"
    )


# -- the joins ----------------------------------------------------------------------------
@dataclass
class _Joins:
    """Who has joined, and whose optimizer steps a joined rank stands in for."""

    joined: list[int] = field(default_factory=list)
    """Ranks in ``hvd.join()`` as of this rank's last round: process-set calls are refused
    meanwhile (a joined rank waits in rounds of the whole job only)."""
    stand_ins: list[Any] = field(default_factory=list)
    """Weak references to the whole job's DistributedOptimizers' gradient syncs, in the
    order built (the same on every rank)."""


def note_round(joined: Sequence[int]) -> None:
    """The ranks in ``hvd.join()``, as a round of the whole job just said."""
    owned(_Joins).joined = list(joined)


def joined_ranks() -> list[int]:
    """The ranks in ``hvd.join()`` as of this rank's last round (empty: none)."""
    return list(owned(_Joins).joined)


def register(sync: object) -> int:
    """Number a whole-job optimizer's gradient sync (built in the same order on every rank):
    its steps' beacons name it, so a joined rank knows whose buckets to stand in for.

    Held weakly, and untyped here: the sync is :mod:`manygpu.horovod.grad_sync`'s, a call
    above this step, which only :mod:`manygpu.horovod.stand_in` reads back."""
    table = owned(_Joins).stand_ins
    table.append(weakref.ref(sync))
    return len(table) - 1


def registered(slot: int) -> Any:
    """The gradient sync numbered ``slot`` here; ``None`` when unknown or dropped."""
    table = owned(_Joins).stand_ins
    ref = table[slot] if 0 <= slot < len(table) else None
    return ref() if ref is not None else None
