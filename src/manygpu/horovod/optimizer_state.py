"""``broadcast_optimizer_state``: every rank gets the root's optimizer state and options.

After the call every rank holds ``root_rank``'s parameter-group options
(learning rate, betas...) and exactly the root's state: the same entries with
the same values, whatever each rank held before (empty, or further along).
The root's layout is sent first (a small pickled description), so a rank that
lacks an entry gets it created and a rank with an entry the root lacks drops
it; then the tensors travel in one broadcast per (device, dtype).

One difference from Horovod, on purpose: Horovod first fills an empty state
with a step on zero gradients, only so that there are tensors to broadcast
into; that step starts Adam's step count at 1 and leaks weight decay into
SGD's momentum. Here an empty root state stays empty everywhere, so training
matches one process that never called this function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from manygpu.errors import UsageError
from manygpu.horovod.basics import session
from manygpu.horovod.functions import broadcast_object, broadcast_tensors


@dataclass(frozen=True, kw_only=True)
class StateSpec:
    """The root's optimizer state, without the tensors' values."""

    group_sizes: list[int]
    """Parameters in each parameter group."""
    options: list[dict[str, Any]]
    """Each group's options (everything but ``params``)."""
    tensors: list[tuple[int, str, tuple[int, ...], torch.dtype, str]]
    """(parameter index, key, shape, dtype, device type) of every state tensor."""
    scalars: list[tuple[int, str, Any]]
    """(parameter index, key, value) of every other state value."""


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def describe_state(optimizer: torch.optim.Optimizer) -> StateSpec:
    """What ``optimizer`` holds, in parameter order (keys sorted)."""
    tensors, scalars = [], []
    for i, p in enumerate(_params(optimizer)):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                tensors.append((i, str(key), tuple(value.shape), value.dtype, value.device.type))
            else:
                scalars.append((i, str(key), value))
    return StateSpec(
        group_sizes=[len(g["params"]) for g in optimizer.param_groups],
        options=[{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        tensors=tensors,
        scalars=scalars,
    )


def apply_spec(optimizer: torch.optim.Optimizer, spec: StateSpec) -> list[tuple[str, torch.Tensor]]:
    """Take the root's options, entries and scalars (tensors made, not filled); list the tensors.

    A rank whose parameter groups differ from the root's keeps its own state:
    the layout check of the broadcast that follows then names the difference.
    """
    params = _params(optimizer)
    if spec.group_sizes != [len(g["params"]) for g in optimizer.param_groups]:
        mine = describe_state(optimizer)
        return [(f"{i}.{k}", optimizer.state[params[i]][k]) for i, k, *_ in mine.tensors]
    for group, options in zip(optimizer.param_groups, spec.options, strict=True):
        group.update(options)
    keep: dict[int, set[str]] = {}
    for index, key in [(t[0], t[1]) for t in spec.tensors] + [(s[0], s[1]) for s in spec.scalars]:
        keep.setdefault(index, set()).add(key)
    for i, p in enumerate(params):  # drop what the root does not have
        if p in optimizer.state:
            for key in [k for k in optimizer.state[p] if k not in keep.get(i, set())]:
                del optimizer.state[p][key]
            if not optimizer.state[p]:
                del optimizer.state[p]
    for i, key, value in spec.scalars:
        optimizer.state[params[i]][key] = value
    named = []
    for i, key, shape, dtype, device_type in spec.tensors:
        p = params[i]
        have = optimizer.state[p].get(key)
        if not (isinstance(have, torch.Tensor) and have.shape == shape and have.dtype == dtype):
            device = torch.device("cpu") if device_type == "cpu" else p.device
            have = torch.zeros(shape, dtype=dtype, device=device)
            optimizer.state[p][key] = have
        named.append((f"{i}.{key}", have))
    return named


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state and group options equal to ``root_rank``'s.

    Works with a plain ``torch.optim`` optimizer or a ``DistributedOptimizer``;
    every rank must call it (it is collective).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UsageError(
            "cannot broadcast torch.optim.LBFGS state (as in Horovod); broadcast the "
            "parameters and let every rank build its own L-BFGS history"
        )
    is_root = session().topology.rank == root_rank
    spec = broadcast_object(
        describe_state(optimizer) if is_root else None, root_rank, name="optimizer_state"
    )
    named = apply_spec(optimizer, spec)
    broadcast_tensors(named, root_rank, "broadcast_optimizer_state")
