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
"""

from __future__ import annotations

import io
import math
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


class ParameterServerError(ManyGPUError, RuntimeError):
    """The parameter-server job cannot go on; the message names the rank at fault."""


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

    @classmethod
    def of(cls, groups: Sequence[dict[str, Any]]) -> HyperLayout:
        """Every numeric setting of every group (sorted keys), as prepared."""
        slots = []
        for gi, group in enumerate(groups):
            for key in sorted(k for k in group if k != "params"):
                found = _numbers(group[key])
                if found is not None:
                    slots.append((gi, key, len(found)))
        return cls(tuple(slots))

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
    """The inverse of :func:`to_bytes`; ``weights_only``: no code runs from a peer's bytes."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


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
