"""Every rank's logged values, reduced per key, after every rank has agreed to go on.

A log call is two all-gathers. First a fixed-size header, the same shape on
every rank whatever it logs: ``[number of keys, CRC-32 of the key names, ok]``,
where ``ok`` is 0 when this rank's own values or ``reduce=`` were refused. Only
when every header is ok and alike do the values follow, as one float64 vector
(keys sorted) whose columns each rank reduces with its own operation (mean,
sum, max, min): one gather whatever mix of reductions the call asks for.

Why the header: a rank that raised on its own input before the collective would
leave the others waiting in it until the timeout, and vectors of different
lengths (a rank logging one key more, say ``mfu`` where its device's peak is
known) break an all-gather that needs equal shapes. After a bad header every
rank exchanges its key names and its error as JSON and raises the same line.
"""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from manygpu.errors import UsageError

OPS = ("mean", "sum", "max", "min", "ratio")
"""``ratio``: the value is a pair ``(sum, count)`` and the result every rank's sums over
every rank's counts: a token-weighted mean loss is ``{"loss": (loss_sum, tokens)}``."""

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's 1-D tensor stacked as rows, in rank order (``Parallel.gather`` of a row)."""
Exchange = Callable[[Any], list[Any]]
"""Every rank's JSON-serialisable object, in rank order (``all_gather_json``)."""


def check_reduce(reduce: Mapping[str, str] | None, keys: Any) -> dict[str, str]:
    """The operation of every key (default ``mean``); an unknown op or key is one line."""
    if reduce is not None and not isinstance(reduce, Mapping):
        raise UsageError(f"log(reduce={reduce!r}): give a dict of names to {', '.join(OPS)}")
    ops = dict(reduce or {})
    for key, op in ops.items():
        if op not in OPS:
            raise UsageError(f"log(reduce={{{key!r}: {op!r}}}): choose one of {', '.join(OPS)}")
        if key not in keys:
            raise UsageError(f"log(reduce=...) names {key!r}, which is not among the values logged")
    return {key: ops.get(key, "mean") for key in keys}


def as_vector(values: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """``values`` (sorted by key) as one float64 vector on ``device``."""
    return torch.stack([_scalar(key, values[key], device) for key in sorted(values)])


def keys_checksum(keys: Sequence[str]) -> int:
    """A CRC-32 of the sorted key names (exact in a float64)."""
    return zlib.crc32("\0".join(sorted(keys)).encode())


def reduce_rows(rows: torch.Tensor, keys: list[str], ops: Mapping[str, str]) -> dict[str, float]:
    """Each key's column of ``rows`` (ranks x keys) reduced with its operation."""
    out = {}
    for i, key in enumerate(keys):
        column = rows[:, i]
        op = ops[key]
        value = column.mean() if op == "mean" else column.sum() if op == "sum" else (
            column.max() if op == "max" else column.min()
        )  # fmt: skip
        out[key] = float(value)
    return out


def reduce_values(
    values: Mapping[str, Any],
    reduce: Mapping[str, str] | None,
    gather: Gather,
    exchange: Exchange,
    device: torch.device,
) -> dict[str, float]:
    """``values`` reduced over the ranks; bad input anywhere is the same line on every rank."""
    keys, problem = _names(values), None
    ops: dict[str, str] = {}
    flat: dict[str, Any] = {}
    flat_ops: dict[str, str] = {}
    try:
        _check_values(values)
        ops = check_reduce(reduce, keys)
        flat, flat_ops = _split_ratios(values, ops)
        row = as_vector(flat, device)
    except UsageError as exc:
        problem = str(exc)
    header = [float(len(keys)), float(keys_checksum(keys)), 0.0 if problem else 1.0]
    heads = gather(torch.tensor([header], dtype=torch.float64, device=device)).to("cpu")
    if bool((heads[:, 2] == 0).any()) or bool((heads[:, :2] != heads[0, :2]).any()):
        raise UsageError(disagreement(exchange({"keys": keys, "error": problem})))
    rows = gather(row[None, :]).to("cpu")
    reduced = reduce_rows(rows, sorted(flat), flat_ops)
    return {key: _joined(reduced, key, op) for key, op in ops.items()}


_NUM, _DEN = "\0sum", "\0count"  # a ratio's two columns: never a name users log


def _split_ratios(
    values: Mapping[str, Any], ops: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Values and ops with each ``ratio`` key split into its summed sum and count."""
    flat: dict[str, Any] = {}
    flat_ops: dict[str, str] = {}
    for key, op in ops.items():
        value = values[key]
        pair = isinstance(value, tuple | list) and len(value) == 2
        if (op == "ratio") != pair:
            raise UsageError(
                f"par.log: {key!r} takes reduce 'ratio' with a (sum, count) pair, and only "
                "then: log {'loss': (loss_sum, tokens)} with reduce={'loss': 'ratio'}"
            )
        if pair:
            flat[key + _NUM], flat[key + _DEN] = value
            flat_ops[key + _NUM] = flat_ops[key + _DEN] = "sum"
        else:
            flat[key], flat_ops[key] = value, op
    return flat, flat_ops


def _joined(reduced: Mapping[str, float], key: str, op: str) -> float:
    if op != "ratio":
        return reduced[key]
    count = reduced[key + _DEN]
    return reduced[key + _NUM] / count if count else float("nan")


def disagreement(sent: list[Any]) -> str:
    """The one line every rank raises, from every rank's ``{"keys", "error"}`` (rank order)."""
    errors = [(r, s.get("error")) for r, s in enumerate(sent) if s.get("error")]
    if errors:
        rank, first = errors[0]
        more = [str(r) for r, _ in errors[1:]]
        also = f" (rank(s) {', '.join(more)} refused their values too)" if more else ""
        return f"rank {rank}: {first}{also}"
    groups: dict[str, list[str]] = {}
    for rank, s in enumerate(sent):
        groups.setdefault(", ".join(s.get("keys") or []) or "no keys", []).append(str(rank))
    each = "; ".join(f"rank(s) {', '.join(ranks)}: {names}" for names, ranks in groups.items())
    return f"par.log: ranks logged different keys ({each}); every rank must log the same keys"


def _names(values: Any) -> list[str]:
    """The keys logged, sorted, as text (what the header's checksum and errors name)."""
    if not isinstance(values, Mapping):
        return []
    return sorted(k if isinstance(k, str) else repr(k) for k in values)


def _check_values(values: Any) -> None:
    if not isinstance(values, Mapping) or not values:
        raise UsageError("par.log takes a non-empty dict of names to numbers or 1-element tensors")
    for key in values:
        if not isinstance(key, str):
            raise UsageError(f"par.log: names must be strings, got {key!r}")


def _scalar(key: str, value: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(key, str):
        raise UsageError(f"par.log: names must be strings, got {key!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UsageError(
                f"par.log: {key!r} is a tensor of {value.numel()} elements; log a number "
                "or a 1-element tensor (e.g. loss.mean())"
            )
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UsageError(f"par.log: {key!r} is {type(value).__name__}; log a number or a tensor")
    return torch.tensor(float(value), dtype=torch.float64, device=device)
