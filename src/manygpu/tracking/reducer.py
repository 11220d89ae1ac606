"""Every rank's logged values, reduced per key in ONE collective.

The values go into one float64 vector, keys sorted, with a checksum of the key
names as its last element; an all-gather brings every rank's vector to every
rank, which reduces each column with its own operation (mean, sum, max, min).
One gather instead of one all-reduce per operation: a log call costs a single
round trip whatever mix of reductions it asks for. The checksum turns ranks
that log different keys into one clear error instead of mixed-up numbers.
"""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from manygpu.errors import UsageError

OPS = ("mean", "sum", "max", "min")

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's 1-D tensor stacked as rows, in rank order (``Parallel.gather`` of a row)."""


def check_reduce(reduce: Mapping[str, str] | None, keys: Any) -> dict[str, str]:
    """The operation of every key (default ``mean``); an unknown op or key is one line."""
    ops = dict(reduce or {})
    for key, op in ops.items():
        if op not in OPS:
            raise UsageError(f"log(reduce={{{key!r}: {op!r}}}): choose one of {', '.join(OPS)}")
        if key not in keys:
            raise UsageError(f"log(reduce=...) names {key!r}, which is not among the values logged")
    return {key: ops.get(key, "mean") for key in keys}


def as_vector(values: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """``values`` (sorted by key) and the keys' checksum as one float64 vector on ``device``."""
    parts = [_scalar(key, values[key], device) for key in sorted(values)]
    parts.append(torch.tensor(float(keys_checksum(values)), dtype=torch.float64, device=device))
    return torch.stack(parts)


def keys_checksum(values: Mapping[str, Any]) -> int:
    """A CRC-32 of the sorted key names (exact in a float64)."""
    return zlib.crc32("\0".join(sorted(values)).encode())


def reduce_rows(rows: torch.Tensor, keys: list[str], ops: Mapping[str, str]) -> dict[str, float]:
    """Each key's column of ``rows`` (ranks x keys+1) reduced with its operation."""
    checks = rows[:, -1]
    if bool((checks != checks[0]).any()):
        raise UsageError(
            "par.log: ranks logged different keys (this rank: "
            f"{', '.join(keys)}); every rank must log the same keys in the same call"
        )
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
    device: torch.device,
) -> dict[str, float]:
    """``values`` reduced over the ranks (one collective, through ``gather``)."""
    if not isinstance(values, Mapping) or not values:
        raise UsageError("par.log takes a non-empty dict of names to numbers or 1-element tensors")
    keys = sorted(values)
    ops = check_reduce(reduce, keys)
    rows = gather(as_vector(values, device)[None, :]).to("cpu")
    return reduce_rows(rows, keys, ops)


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
