"""What parameter servers and workers say to each other, as plain functions and layouts.

Every message starts with a fixed-length ``float64`` header whose length both
sides compute from facts they share (the model's parameters, the optimizer's
param groups, the server and worker counts), followed by flat tensors:

worker -> server ``[kind, step, clip max_norm, clip norm_type, hypers..., present...]``
    ``hypers``: every number in every param group (lr, momentum, betas,
    weight decay...), so an LR scheduler's changes on the workers reach the
    servers' optimizers with each push; ``present``: per parameter of the
    shard, whether this worker has a gradient for it.
server -> worker ``[aux, version, lag, tau, norm, live, lag of each worker...]``
    ``version``: updates the server applied; ``lag``: how many steps this
    worker is ahead of the slowest live one as it starts its next step;
    ``tau``: updates applied between this worker's pull and its push (the
    classic gradient delay); ``aux``: the byte count of a state that follows.

Parameters are split over the servers by size (largest first onto the least
loaded server), so parameters and optimizer state are balanced.

A server trusts no number a worker sends: every size, count and index is
checked against what it holds (:func:`request_problem`, :func:`state_problem`)
before anything is allocated or indexed, so a lying or buggy worker gets a
one-line refusal naming it instead of ending the server with an allocation
failure or a traceback.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from manygpu.errors import ManyGPUError

PUSH, STEP, FETCH, LOAD, BYE, INIT = 1.0, 2.0, 3.0, 4.0, 5.0, 6.0
"""Message kinds (slot 0 of a worker's header)."""
KIND_NAMES = {PUSH: "push", STEP: "step", FETCH: "fetch", LOAD: "load", BYE: "bye", INIT: "init"}
REQUEST_FIXED = 4
"""Slots before the hyper-parameters: kind, step, clip max_norm, clip norm_type."""
REPLY_FIXED = 6
"""Slots before the per-worker lags: aux, version, lag, tau, norm, live."""
GONE = -1.0
"""A worker's lag in a reply once it has left (finished or dropped)."""
STATE_COPIES = 16
"""A state to load may hold this many copies of the shard's bytes: Adam keeps two, with
``amsgrad`` three, at most at twice the parameters' width (fp32 state of bf16 weights)."""
STATE_OVERHEAD = 16 * 2**20
"""Bytes a state may hold beyond its tensors: the param groups (``param_names`` included)."""
STATE_PER_TENSOR = 4096
"""Bytes of archive and pickle per parameter of the shard (a few state entries each)."""


class ParameterServerError(ManyGPUError, RuntimeError):
    """The parameter-server job cannot go on; the message names the rank at fault."""


class BadMessage(ParameterServerError):
    """A worker sent what the protocol does not allow; the text says what, without the rank.

    The server adds who sent it and what happens next: in sync mode the job
    ends, in async mode the server drops that worker and goes on.
    """


def count(value: float, low: int, high: int) -> int | None:
    """``value`` as an int when it is a whole number in ``[low, high]``, else ``None``.

    Header slots are ``float64``: NaN, infinities and fractions are refused
    here, before ``int()`` could raise or a size could reach an allocation.
    """
    if not math.isfinite(value) or not float(value).is_integer() or not low <= value <= high:
        return None
    return int(value)


def shown(value: float) -> str:
    """A header number as an error shows it: ``1,000,000,000,000``, ``-5``, ``nan``, ``2.5``."""
    if math.isfinite(value) and float(value).is_integer():
        return f"{int(value):,}"
    return repr(float(value))


def state_limit(numel: int, itemsize: int, tensors: int) -> int:
    """The most bytes a state to load (or a fetched one) may have for a shard of this size."""
    return STATE_OVERHEAD + STATE_COPIES * numel * itemsize + STATE_PER_TENSOR * tensors


def balance(sizes: Sequence[int], servers: int) -> list[tuple[int, ...]]:
    """Parameter indices per server: largest first onto the least-loaded server.

    Deterministic (ties go to the lower server, equal sizes keep their order),
    so every rank computes the same split from the same model.
    """
    loads = [0] * servers
    owned: list[list[int]] = [[] for _ in range(servers)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(servers), key=lambda s: (loads[s], s))
        loads[target] += sizes[index]
        owned[target].append(index)
    return [tuple(sorted(indices)) for indices in owned]


def _numbers(value: Any) -> list[float] | None:
    """A group value as floats, or ``None`` when it is not a number (flags, None, strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return [float(value.item())]
    if isinstance(value, tuple | list) and value and all(_numbers(v) is not None for v in value):
        return [float(v) for v in value]
    return None


@dataclass(frozen=True)
class HyperLayout:
    """Which numbers of which param group travel with each push, and where."""

    slots: tuple[tuple[int, str, int], ...]
    """(group index, key, how many numbers) in header order."""
    groups: int
    """How many param groups the optimizer has (a state to load must have as many)."""

    @classmethod
    def of(cls, groups: Sequence[dict[str, Any]]) -> HyperLayout:
        """Every numeric setting of every group (sorted keys), as prepared."""
        slots = []
        for gi, group in enumerate(groups):
            for key in sorted(k for k in group if k != "params"):
                found = _numbers(group[key])
                if found is not None:
                    slots.append((gi, key, len(found)))
        return cls(tuple(slots), len(groups))

    @property
    def size(self) -> int:
        return sum(n for _, _, n in self.slots)

    def pack(self, groups: Sequence[dict[str, Any]]) -> list[float]:
        """The current values, in slot order."""
        out: list[float] = []
        for gi, key, n in self.slots:
            found = _numbers(groups[gi][key])
            if found is None or len(found) != n:
                raise ParameterServerError(
                    f"param group {gi}'s {key!r} changed shape or type during training "
                    f"({groups[gi][key]!r}); parameter servers can follow changed values only"
                )
            out += found
        return out

    def unpack(self, values: Sequence[float], groups: dict[int, dict[str, Any]]) -> None:
        """Set ``values`` into ``groups`` (user group index -> this server's group)."""
        at = 0
        for gi, key, n in self.slots:
            part, at = values[at : at + n], at + n
            group = groups.get(gi)
            if group is None:
                continue
            old = group[key]
            if isinstance(old, torch.Tensor):
                old.fill_(part[0])
            elif n == 1:
                group[key] = part[0]
            else:
                group[key] = type(old)(part)


@dataclass(frozen=True)
class Layout:
    """Header lengths of one (server, worker) pair: both sides build the same one."""

    hypers: HyperLayout
    params: int
    """Parameters held by this pair's server."""
    workers: int

    @property
    def request(self) -> int:
        return REQUEST_FIXED + self.hypers.size + self.params

    @property
    def reply(self) -> int:
        return REPLY_FIXED + self.workers

    def new_request(self) -> torch.Tensor:
        return torch.zeros(self.request, dtype=torch.float64)

    def new_reply(self) -> torch.Tensor:
        return torch.zeros(self.reply, dtype=torch.float64)

    def presence(self, header: torch.Tensor) -> list[bool]:
        """Per parameter of the shard: whether the sender had a gradient for it."""
        start = REQUEST_FIXED + self.hypers.size
        return [bool(v) for v in header[start : start + self.params].tolist()]

    def hyper_values(self, header: torch.Tensor) -> list[float]:
        return header[REQUEST_FIXED : REQUEST_FIXED + self.hypers.size].tolist()


def request_problem(layout: Layout, header: torch.Tensor, load_limit: int) -> str | None:
    """What is wrong with a worker's header (after its first message), or ``None``.

    ``load_limit``: the most bytes a state to load may have (:func:`state_limit`).
    """
    values = header.tolist()
    kind = values[0]
    if kind not in KIND_NAMES or kind == INIT:
        return (
            f"sent an unknown message (kind {kind!r}); run the same manygpu version on every rank"
        )
    if kind == LOAD and count(values[1], 1, load_limit) is None:
        return (
            f"sent a state of {shown(values[1])} bytes to load; this server takes at most "
            f"{load_limit:,} for its shard"
        )
    if kind != PUSH:
        return None
    max_norm, norm_type = values[2], values[3]
    if math.isnan(max_norm) or (max_norm > 0 and not norm_type > 0):
        return (
            f"asked to clip to {max_norm!r} by the {norm_type!r}-norm; clipping needs a "
            "positive max_norm and a positive norm type (or inf)"
        )
    start = REQUEST_FIXED + layout.hypers.size
    flags = values[start : start + layout.params]
    bad = next((i for i, v in enumerate(flags) if v not in (0.0, 1.0)), None)
    if bad is not None:
        return (
            f"sent a push whose gradient flag {bad} is {flags[bad]!r} (0 or 1 expected) for "
            f"this server's {layout.params:,} parameters"
        )
    return None


def state_problem(saved: Any, *, shard: dict[int, torch.Tensor], groups: int) -> str | None:
    """What is wrong with a state a worker sent to load, or ``None``.

    Args:
        saved: what :func:`from_bytes` read (``params``, ``state``, ``groups``).
        shard: global parameter index -> this server's parameter.
        groups: the optimizer's param-group count.
    """
    if not isinstance(saved, dict) or not {"params", "state", "groups"} <= saved.keys():
        return "sent a state to load without its params, state and groups"
    numel = sum(p.numel() for p in shard.values())
    dtype = next(iter(shard.values())).dtype
    flat = saved["params"]
    if not _dense(flat, numel) or flat.dim() != 1 or flat.numel() != numel or flat.dtype != dtype:
        what = f"{flat.dtype}[{flat.numel():,}]" if isinstance(flat, torch.Tensor) else "no tensor"
        return f"sent {what} parameters to load; this server holds {dtype}[{numel:,}]"
    state = saved["state"]
    if not isinstance(state, dict):
        return "sent an optimizer state to load that is not a dict"
    for index, entry in state.items():
        if type(index) is not int or index not in shard:
            return (
                f"sent optimizer state for parameter {index!r}; this server holds parameters "
                f"{_span(shard)}"
            )
        size = max(shard[index].numel(), 1)
        if not isinstance(entry, dict) or not all(_state_value(v, size) for v in entry.values()):
            return (
                f"sent optimizer state for parameter {index} that is not a dict of numbers and "
                f"tensors of at most its {size:,} elements"
            )
    saved_groups = saved["groups"]
    if not isinstance(saved_groups, list) or len(saved_groups) != groups:
        found = len(saved_groups) if isinstance(saved_groups, list) else "no list of"
        return f"sent {found} param groups to load; the optimizer has {groups}"
    if not all(isinstance(g, dict) and all(type(k) is str for k in g) for g in saved_groups):
        return "sent param groups to load that are not dicts keyed by name"
    return None


def _dense(value: Any, limit: int) -> bool:
    """A plain (strided) tensor of at most ``limit`` elements: no sparse or huge views."""
    return (
        isinstance(value, torch.Tensor) and value.layout == torch.strided and value.numel() <= limit
    )


def _state_value(value: Any, size: int) -> bool:
    """One entry of a parameter's optimizer state: a number, None, or a small tensor."""
    return value is None or isinstance(value, int | float) or _dense(value, size)


def _span(shard: dict[int, torch.Tensor]) -> str:
    """The shard's global indices, the first few of a long list."""
    indices = sorted(shard)
    if len(indices) <= 6:
        return ", ".join(map(str, indices))
    return f"{', '.join(map(str, indices[:5]))}, ... ({len(indices):,} in all)"


def fill_request(
    header: torch.Tensor,
    kind: float,
    *,
    step: int = 0,
    clip: tuple[float, float] | None = None,
    hypers: Sequence[float] = (),
    present: Sequence[bool] = (),
) -> torch.Tensor:
    """Write a worker's header in place (``clip``: max_norm and norm_type, or none)."""
    header.zero_()
    header[0], header[1] = kind, float(step)
    if clip is not None:
        header[2], header[3] = clip
    values = list(hypers) + [1.0 if p else 0.0 for p in present]
    if values:
        header[REQUEST_FIXED : REQUEST_FIXED + len(values)] = torch.tensor(
            values, dtype=torch.float64
        )
    return header


def clip_of(header: torch.Tensor) -> tuple[float, float] | None:
    """The clipping a push asks for (max_norm, norm_type), or ``None``."""
    max_norm = float(header[2])
    return (max_norm, float(header[3])) if max_norm > 0 else None


@dataclass(frozen=True)
class Reply:
    """A server's answer, read from its header."""

    aux: int
    version: int
    lag: int
    tau: int
    norm: float
    live: int
    lags: tuple[int, ...]
    """Every worker's lag as the server last saw it (``-1``: gone)."""

    @classmethod
    def read(cls, header: torch.Tensor) -> Reply:
        values = header.tolist()
        return cls(
            aux=int(values[0]),
            version=int(values[1]),
            lag=int(values[2]),
            tau=int(values[3]),
            norm=float(values[4]),
            live=int(values[5]),
            lags=tuple(int(v) for v in values[REPLY_FIXED:]),
        )

    def write(self, header: torch.Tensor) -> torch.Tensor:
        fixed = [self.aux, self.version, self.lag, self.tau, self.norm, self.live]
        header.copy_(torch.tensor([*fixed, *self.lags], dtype=torch.float64))
        return header


def to_bytes(obj: Any) -> torch.Tensor:
    """``obj`` (tensors, numbers, dicts, lists) as a ``uint8`` tensor, via ``torch.save``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    """The inverse of :func:`to_bytes`; ``weights_only``: no code runs from a peer's bytes.

    ``torch.load`` allocates each archive entry at the size its directory
    names: entries must be stored (never compressed) and within the bytes
    received, so a small message cannot ask for a large allocation.
    """
    raw = data.numpy().tobytes()
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        for entry in archive.infolist():
            if entry.compress_type != zipfile.ZIP_STORED or entry.file_size > len(raw):
                raise ValueError(f"archive entry {entry.filename[:60]!r} is not a stored tensor")
    return torch.load(io.BytesIO(raw), weights_only=True)


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One contiguous CPU ``dtype`` vector of ``tensors`` (empty: a zero-length vector)."""
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
    return flat.cpu() if flat.device.type != "cpu" else flat


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (in place, on their devices and dtypes)."""
    at = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[at : at + n].view_as(t))
        at += n


def clip_coefficient(max_norm: float, norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))``: torch's clipping factor."""
    if math.isnan(norm):
        return float("nan")
    return min(1.0, max_norm / (norm + 1e-6))
