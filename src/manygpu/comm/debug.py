"""Debug mode: check that every rank calls the same collective, before calling it.

A rank that calls ``all_reduce`` on 4 floats while another calls it on 8, or
calls ``all_gather`` instead, makes NCCL/gloo hang or silently mix data. In
debug mode each collective first all-gathers a small fingerprint (operation,
dtype, shape, the call's number on this rank and where in the user's code it
was made) and raises :class:`CollectiveMismatchError` naming the ranks that
differ. The number catches what shapes cannot: a rank that makes an extra
call (at :func:`check_end` the others are done) or skips one. A skipped call
between two of one shape is seen only at :func:`check_end`, after the ranks
have already mixed the two; the strict level (``MANYGPU_DEBUG=strict``)
compares the call site too (``file:line``, or the name a Horovod collective
carries), so it is seen at the call, before any data moves. Its one false
positive: ranks that reach one collective from different lines
(``if rank == 0: x = reduce(a) else: x = reduce(a)``). Each check costs one
tiny all-gather of integers; only a mismatch exchanges the call sites' text
(as JSON). For finding bugs, not production.
"""

from __future__ import annotations

import os
import sys
import weakref
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from manygpu.comm.common import all_gather_single, scratch_device, wait
from manygpu.comm.objects import all_gather_json
from manygpu.errors import ManyGPUError
from manygpu.runtime import env as envmod
from manygpu.runtime.ranks import ranks_text

_WIDTH = 16  # op, dtype, ndim, 8 dims, extra, call number, site hash, line, strict
_MAX_DIMS = 8
_SEQ, _SITE, _LINE, _STRICT = 12, 13, 14, 15
_END_SITE = "end of the job"
_calls: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
"""Collectives checked so far, per process group. Keyed by the group itself, weakly:
a group made after the last one was destroyed (``hvd.init()`` after ``hvd.shutdown()``)
may get the dead one's ``id()``, and would then go on counting from its calls on
some ranks only."""
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
    "joined",
]
JOINED = "joined"
"""The row of a rank in ``hvd.join()``: it stands in for the others' call, so it is left
out of the comparison (:mod:`manygpu.horovod.joining`)."""
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


def _site(site: str | None) -> tuple[str, int, int]:
    """(how the call site is shown, its hash, its line) for ``site`` or the user's line.

    A file is known by its base name, not its path: hosts may keep the same
    script in different directories.
    """
    if site is not None:
        return site, zlib.crc32(site.encode()), -1
    file, line = _call_site()
    base = os.path.basename(file)
    return f"at {base}:{line}", zlib.crc32(base.encode()), line


def _fingerprint(
    op: str,
    tensor: torch.Tensor | None,
    shape: tuple[int, ...] | None,
    extra: int,
    seq: int,
    site: tuple[str, int, int],
    strict: bool,
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
    row[_SEQ] = seq
    row[_SITE], row[_LINE] = site[1], site[2]
    row[_STRICT] = int(strict)
    return row


def _render(row: list[int], site: str) -> str:
    op = _OPS[row[0]] if 0 <= row[0] < len(_OPS) else "?"
    if row[0] == _OPS.index("end of the job"):
        return f"{op} after {row[_SEQ] - 1} calls"
    where = f" {site} as call #{row[_SEQ]}"
    if row[1] < 0:
        return f"{op}{where}"
    dtype = str(_DTYPES[row[1]]).removeprefix("torch.") if row[1] < len(_DTYPES) else "?"
    dims = ["*" if d == ANY else str(d) for d in row[3 : 3 + row[2]]]
    extra = f", arg={row[11]}" if row[11] >= 0 else ""
    return f"{op}({dtype}[{'x'.join(dims) or 'scalar'}]{extra}){where}"


def _sites(mine: str, timeout_s: float) -> list[str]:
    """Every rank's call site as text (only after a mismatch: every rank is here)."""
    sites = all_gather_json(mine, operation="debug check's call sites", timeout_s=timeout_s)
    return [s[:200] if isinstance(s, str) else "?" for s in sites]


def check_same_call(
    op: str,
    tensor: torch.Tensor | None,
    *,
    timeout_s: float,
    shape: tuple[int, ...] | None = None,
    extra: int = -1,
    site: str | None = None,
    strict: bool | None = None,
) -> None:
    """Raise on every rank if any rank is about to call something else (joined ranks aside).

    Args:
        op: the collective's name.
        tensor: its tensor (dtype and shape are compared).
        shape: the shape to compare instead, with :data:`ANY` for free dimensions.
        extra: an argument that must agree (reduce op, root rank), -1 for none.
        site: what identifies the call in strict mode instead of the user's
            ``file:line``, as errors show it (``named 'loss'``, ``in bucket 3``).
        strict: compare call sites too; ``None`` reads ``MANYGPU_DEBUG``. One
            strict rank makes the check strict on every rank, so all decide alike.
    """
    table = gather_calls(
        op, tensor, timeout_s=timeout_s, shape=shape, extra=extra, site=site, strict=strict
    )
    compare_calls(table, timeout_s=timeout_s)


@dataclass(frozen=True)
class CallTable:
    """Every rank's fingerprint of the call it is about to make, in rank order."""

    rows: list[tuple[int, ...]]
    site: str
    """This rank's call site, as errors show it."""

    def joined(self) -> list[int]:
        """Ranks in ``hvd.join()`` (their row stands in; see :data:`JOINED`)."""
        mark = _OPS.index(JOINED)
        return [r for r, row in enumerate(self.rows) if row[0] == mark]

    def same(self, ranks: list[int]) -> bool:
        """Whether ``ranks`` call the same thing (call sites compared in strict mode)."""
        strict = any(r[_STRICT] for r in self.rows)
        return len({self.rows[r][: _STRICT if strict else _SITE] for r in ranks}) <= 1


def gather_calls(
    op: str,
    tensor: torch.Tensor | None,
    *,
    timeout_s: float,
    shape: tuple[int, ...] | None = None,
    extra: int = -1,
    site: str | None = None,
    strict: bool | None = None,
) -> CallTable:
    """Every rank's fingerprint (one tiny all-gather); :func:`check_same_call`'s first half."""
    key = dist.group.WORLD
    _calls[key] = seq = _calls.get(key, 0) + 1
    if strict is None:
        strict = envmod.debug_strict(envmod.current())
    where = _site(site)
    row = _fingerprint(op, tensor, shape, extra, seq, where, strict).to(scratch_device())
    world = dist.get_world_size()
    table = torch.empty((world, _WIDTH), dtype=torch.int64, device=row.device)
    work = all_gather_single(table, row.unsqueeze(0), async_op=True)
    wait(work, f"debug check before {op}", timeout_s)
    return CallTable(rows=[tuple(r) for r in table.cpu().tolist()], site=where[0])


def compare_calls(table: CallTable, *, timeout_s: float) -> None:
    """Raise on every rank if the ranks' calls differ (rows of joined ranks left out)."""
    full = table.rows
    joined = set(table.joined())
    # By default the call site is shown, not compared: ranks may reach one
    # collective from different lines (if rank == 0: ... else: ...).
    # Operation, shape and the call's number must agree.
    if table.same([r for r in range(len(full)) if r not in joined]):
        return
    strict = any(r[_STRICT] for r in full)
    rows = [r[:_STRICT] if strict else r[:_SITE] for r in full]
    # Every rank holds the same table, so every rank is here: one more collective is safe.
    sites = _sites(table.site, timeout_s)
    raise CollectiveMismatchError(_mismatch_text(full, rows, sites, strict))


def _mismatch_text(
    full: list[tuple[int, ...]], rows: list[tuple[int, ...]], sites: list[str], strict: bool
) -> str:
    world = len(rows)
    common, _ = Counter(rows).most_common(1)[0]
    odd = [r for r, row_r in enumerate(rows) if row_r != common]
    majority = [r for r in range(world) if r not in odd]
    calls = "; ".join(f"rank {r} calls {_render(list(full[r]), sites[r])}" for r in odd)
    who = f"{ranks_text(majority)} {'calls' if len(majority) == 1 else 'call'}"
    same_but_site = all(rows[r][:_SITE] == common[:_SITE] for r in odd)
    why = (
        "the ranks reached this collective from different lines: one skipped a call before "
        "it, or (strict mode's one false positive) the same collective is written on two lines"
        if strict and same_but_site
        else "every rank must run the same collectives with the same shapes and dtypes in "
        "the same order (a rank that skipped or added a call is the one whose call numbers "
        "differ)"
    )
    level = " (MANYGPU_DEBUG=strict: call sites compared)" if strict else ""
    return (
        f"rank {dist.get_rank()}: collective mismatch{level}: {who} "
        f"{_render(list(full[majority[0]]), sites[majority[0]])}, but {calls}; {why}"
    )


def check_end(*, timeout_s: float) -> None:
    """At the end of a job: every rank must have made the same number of calls.

    A rank with an extra call is still waiting in that call's check, which
    meets this one and names it; a rank that skipped one arrives here early.
    """
    check_same_call("end of the job", None, timeout_s=timeout_s, site=_END_SITE)
