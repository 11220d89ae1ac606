"""How errors name a call, a mismatch and a stall; the call numbers a stall compares.

Horovod's coordinator matches every collective by name across ranks, so a
rank that sends a different shape gets "Mismatched allreduce tensor shapes"
and a rank that never calls makes the others report it as stalled. Every step
of a call reports through this module: the cross-rank check's table of who
calls what (:func:`render_mismatch`, :class:`HorovodMismatchError`), and the
notes of a stall. When a collective times out, each waiting rank leaves a note
in the job's store and reads the others': the ranks with no note never started
the collective, and the error names them (:func:`named_stall`). Nothing is
written while all is well.

It owns one piece of state: each rank's count of the collectives it started,
per scope (the whole job, each process set), which the notes compare. Every
step numbers a call through :func:`next_call`; a removed set's count goes
with it (:func:`forget_set`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from manygpu.comm.debug import CollectiveMismatchError
from manygpu.comm.objects import PayloadError
from manygpu.errors import CollectiveTimeoutError, peer_lost
from manygpu.horovod.basics import Scope, owned, session
from manygpu.horovod.exceptions import internal
from manygpu.runtime.ranks import ranks_text

Entry = tuple[str, tuple[int, ...], str]
"""(name, shape, dtype) of one tensor in a layout."""

_STALL_KEY = "manygpu/horovod/stall/"
_GRACE_S = 5.0
"""How long a rank that timed out waits for the other waiting ranks' notes."""


# -- call numbers ---------------------------------------------------------------------
@dataclass
class _Calls:
    """Collectives this rank has started, per scope id (0: the whole job)."""

    started: dict[int, int] = field(default_factory=dict)


def next_call(scope: Scope | None = None) -> int:
    """This rank's number for a new collective on ``scope`` (``None``: the whole job)."""
    set_id = 0 if scope is None else scope.set_id
    started = owned(_Calls).started
    started[set_id] = started.get(set_id, 0) + 1
    return started[set_id]


def calls_made() -> int:
    """Collectives this rank has started on the whole job (a stall's reference number)."""
    return owned(_Calls).started.get(0, 0)


def forget_set(set_id: int) -> None:
    """A process set was removed: its numbers start again if its id is reused."""
    owned(_Calls).started.pop(set_id, None)


# -- how errors name calls ---------------------------------------------------------------
class HorovodMismatchError(CollectiveMismatchError):
    """Ranks called different collectives, or the same one on different tensors."""


def describe(what: str, tensor: torch.Tensor | None, name: str | None, **args: object) -> str:
    """``allreduce('loss', float32[4], op=Average)``: how errors name a call."""
    parts = [repr(name)] if name is not None else []
    if tensor is not None:
        shape = "x".join(str(s) for s in tensor.shape) or "scalar"
        parts.append(f"{str(tensor.dtype).removeprefix('torch.')}[{shape}]")
    parts += [f"{k}={v}" for k, v in args.items()]
    return f"{what}({', '.join(parts)})"


def parse_row(row: object, *, sender: int, operation: str) -> tuple[str, list[Entry] | None]:
    """A rank's ``[desc, details]`` as it arrived in JSON, checked; shapes back to tuples."""

    def bad(what: str) -> PayloadError:
        me = dist.get_rank() if dist.is_initialized() else 0
        return PayloadError(me, operation, sender, what)

    if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)):
        raise bad("expected [description, layout]")
    desc, details = row
    if details is None:
        return desc, None
    if not isinstance(details, list):
        raise bad("the layout is not a list")
    entries: list[Entry] = []
    for i, entry in enumerate(details):
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and isinstance(entry[1], list)
            and all(type(d) is int and d >= 0 for d in entry[1])
            and isinstance(entry[2], str)
        ):
            raise bad(f"layout entry {i} is not [name, shape, dtype]")
        entries.append((entry[0], tuple(entry[1]), entry[2]))
    return desc, entries


def render_mismatch(
    rows: Sequence[tuple[str, list[Entry] | None]],
    fallback: str,
    ranks: Sequence[int] | None = None,
) -> str:
    """One line naming which ranks call what (or which tensors differ in a layout).

    ``ranks``: the global rank of each row (a process set's), when not ``0..len(rows)-1``.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    ids = list(ranks) if ranks is not None else list(range(len(rows)))
    head = f"rank {rank}: manygpu.horovod: ranks disagree on a collective: "
    layouts = [d for _, d in rows]
    if all(d is not None for d in layouts) and len({repr(d) for d in layouts}) > 1:
        what = rows[0][0].split("(")[0]
        return f"{head}{what}: {layout_diff([d for d in layouts if d is not None], ids)}"
    groups: dict[str, list[int]] = {}
    for r, (desc, _) in enumerate(rows):
        groups.setdefault(desc, []).append(ids[r])
    if len(groups) == 1:
        return fallback  # same call everywhere: the call numbers differ (a skipped call)
    said = "; ".join(
        f"{ranks_text(ranks)} {'calls' if len(ranks) == 1 else 'call'} {desc}"
        for desc, ranks in groups.items()
    )
    return head + said + " (every rank must make the same calls with the same shapes)"


def layout_diff(per_rank: Sequence[Sequence[Entry]], ids: Sequence[int] | None = None) -> str:
    """What differs between ranks' lists of tensors: missing names, shapes, dtypes, order.

    ``ids``: the global rank of each list, when not ``0..len(per_rank)-1``.
    """
    who = list(ids) if ids is not None else list(range(len(per_rank)))
    maps = [{name: (shape, dtype) for name, shape, dtype in entries} for entries in per_rank]
    names = list(dict.fromkeys(name for entries in per_rank for name, _, _ in entries))
    problems = []
    for name in names:
        present = [r for r, m in zip(who, maps, strict=True) if name in m]
        if len(present) < len(maps):
            problems.append(f"{name!r} exists only on {ranks_text(present)}")
            continue
        kinds: dict[str, list[int]] = {}
        for r, m in zip(who, maps, strict=True):
            shape, dtype = m[name]
            kind = f"{dtype.removeprefix('torch.')}[{'x'.join(map(str, shape)) or 'scalar'}]"
            kinds.setdefault(kind, []).append(r)
        if len(kinds) > 1:
            said = ", ".join(f"{kind} on {ranks_text(ranks)}" for kind, ranks in kinds.items())
            problems.append(f"{name!r} is {said}")
    if not problems:
        orders: dict[str, list[int]] = {}
        for r, entries in zip(who, per_rank, strict=True):
            orders.setdefault(repr([n for n, _, _ in entries]), []).append(r)
        return "the same tensors in a different order on " + " vs ".join(
            ranks_text(ranks) for ranks in orders.values()
        )
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return "; ".join(problems[:5]) + more


def describe_stall(
    records: Mapping[int, tuple[int, str]],
    world: int,
    seq: int,
    ranks: Sequence[int] | None = None,
) -> str:
    """Who is missing, from the notes of the ranks that timed out (``rank -> (call, desc)``).

    ``ranks``: those that should have joined (a process set's), by default ``0..world-1``.
    """
    waiting = sorted(r for r, (s, _) in records.items() if s == seq)
    absent = [r for r in (range(world) if ranks is None else ranks) if r not in records]
    parts = []
    if absent:
        parts.append(f"missing ranks: {absent} never started this collective")
    parts += [
        f"rank {r} is stuck in its own call #{s} {d}"
        for r, (s, d) in sorted(records.items())
        if s != seq
    ]
    parts.append(f"{ranks_text(waiting)} waited in it")
    return "; ".join(parts)


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def missing_ranks(seq: int, desc: str, scope: Scope | None = None) -> str:
    """Leave this rank's note, wait a little for the others' and say who is missing.

    In a process set, only its ranks are asked, under keys of the set's own (its
    call numbers are its own).
    """
    s = session()
    me, world = s.topology.rank, s.topology.size
    store = _store()
    if store is None:
        return "could not ask the other ranks which are missing (no store)"
    ranks = list(range(world)) if scope is None or scope.whole else list(scope.ranks)
    prefix = _STALL_KEY if scope is None or scope.whole else f"{_STALL_KEY}set{scope.set_id}/"
    keys = {r: f"{prefix}{r}" for r in ranks}
    records = {me: (seq, desc)}
    try:
        store.set(keys[me], f"{seq}\t{desc}")
        deadline = time.monotonic() + min(_GRACE_S, s.timeout_s)
        while time.monotonic() < deadline and not store.check(list(keys.values())):
            time.sleep(0.1)
        for r in ranks:
            if r != me and store.check([keys[r]]):
                number, _, what = store.get(keys[r]).decode().partition("\t")
                records[r] = (int(number), what)
    except (RuntimeError, ValueError) as exc:  # the store's host is gone too
        return f"could not ask the other ranks which are missing ({exc})"
    return describe_stall(records, world, seq, ranks)


def named_stall(
    exc: CollectiveTimeoutError, seq: int, desc: str, scope: Scope | None = None
) -> CollectiveTimeoutError | None:
    """The timeout re-raised with the missing ranks named (as is when a peer died instead).

    Either way a :class:`~manygpu.horovod.exceptions.HorovodCollectiveError`: still
    manygpu's timeout error, and what a script catching ``hvd.HorovodInternalError`` sees.
    """
    if peer_lost(str(exc)):
        return internal(exc)
    s = session()
    said = missing_ranks(seq, desc, scope)
    return internal(CollectiveTimeoutError(s.topology.rank, desc, s.timeout_s, said))
