"""``broadcast_optimizer_state``: every rank gets the root's optimizer state and options.

After the call every rank holds ``root_rank``'s parameter-group options
(learning rate, betas...) and exactly the root's state: the same entries with
the same values, whatever each rank held before (empty, or further along).
The root's layout is sent first (a small JSON description, never a pickle:
nothing another rank sends is executed, and what arrives is checked field by
field), so a rank that lacks an entry gets it created and a rank with an
entry the root lacks drops it; then the tensors travel in one broadcast per
(device, dtype). Options and scalar state may be numbers, strings, booleans,
``None``, lists, tuples, dicts with string keys and tensors (``lr`` may be
one); anything else is an error on every rank naming the entry.

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

from manygpu.comm.objects import PayloadError, broadcast_json
from manygpu.errors import UsageError
from manygpu.horovod.basics import session
from manygpu.horovod.checks import agree
from manygpu.horovod.data_ops import check_root
from manygpu.horovod.functions import broadcast_tensors

_OPERATION = "broadcast_optimizer_state"
_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
"""Every dtype by name: the only dtypes a received layout may name."""
_TAGS = ("tuple", "list", "dict", "Tensor")


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


class _Unsendable(Exception):
    """A value the root cannot describe in JSON; the message says where it is."""


def value_to_json(value: Any, where: str) -> Any:
    """``value`` as JSON, containers and tensors tagged so that they come back as they were."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        tag = "tuple" if isinstance(value, tuple) else "list"
        return {tag: [value_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: value_to_json(v, f"{where}[{k!r}]") for k, v in value.items()}}
    if isinstance(value, torch.Tensor) and not value.is_complex() and value.layout == torch.strided:
        dtype = str(value.dtype).removeprefix("torch.")
        return {"Tensor": [dtype, list(value.shape), value.device.type, value.tolist()]}
    raise _Unsendable(f"{where} is a {type(value).__name__}")


def value_from_json(data: Any, where: str) -> Any:
    """Inverse of :func:`value_to_json`; ``ValueError`` naming ``where`` when malformed."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if not (isinstance(data, dict) and len(data) == 1 and next(iter(data)) in _TAGS):
        raise ValueError(f"{where} is not a tagged value")
    tag, body = next(iter(data.items()))
    if tag in ("tuple", "list") and isinstance(body, list):
        items = [value_from_json(v, f"{where}[{i}]") for i, v in enumerate(body)]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict" and isinstance(body, dict):
        return {k: value_from_json(v, f"{where}[{k!r}]") for k, v in body.items()}
    if tag == "Tensor" and isinstance(body, list) and len(body) == 4:
        return _tensor_from_json(body, where)
    raise ValueError(f"{where} is a malformed {tag}")


def _tensor_from_json(body: list[Any], where: str) -> torch.Tensor:
    dtype_name, shape, device_type, values = body
    if dtype_name not in _DTYPES or not _is_shape(shape) or device_type not in ("cpu", "cuda"):
        raise ValueError(f"{where} is a malformed tensor")
    try:
        tensor = torch.tensor(values, dtype=_DTYPES[dtype_name])
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ValueError(f"{where} holds values that are not a {dtype_name} tensor") from None
    if list(tensor.shape) != shape:
        raise ValueError(f"{where} has values of shape {list(tensor.shape)}, not {shape}")
    return tensor if device_type == "cpu" else tensor.to(device_type)


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(type(d) is int and d >= 0 for d in value)


def spec_to_json(spec: StateSpec) -> dict[str, Any]:
    """The root's layout as JSON (``_Unsendable`` naming an entry JSON cannot carry)."""
    return {
        "group_sizes": spec.group_sizes,
        "options": [
            {k: value_to_json(v, f"option {k!r} of group {g}") for k, v in options.items()}
            for g, options in enumerate(spec.options)
        ],
        "tensors": [
            [i, key, list(shape), str(dtype).removeprefix("torch."), device]
            for i, key, shape, dtype, device in spec.tensors
        ],
        "scalars": [
            [i, key, value_to_json(value, f"state {key!r} of parameter {i}")]
            for i, key, value in spec.scalars
        ],
    }


_SPEC_KEYS = ("group_sizes", "options", "tensors", "scalars")


def _entry(item: Any, width: int, count: int, what: str) -> list[Any]:
    """``[parameter index, key, ...]`` of ``width`` fields, the index below ``count``."""
    if (
        isinstance(item, list)
        and len(item) == width
        and type(item[0]) is int
        and 0 <= item[0] < count
        and isinstance(item[1], str)
    ):
        return item
    raise ValueError(f"{what} {item!r:.80} is not [parameter index, key, ...]")


def spec_from_json(data: Any) -> StateSpec:
    """The layout a root sent, checked field by field; ``ValueError`` saying what is wrong."""
    if not (isinstance(data, dict) and set(data) == set(_SPEC_KEYS)):
        raise ValueError(f"expected an object with {', '.join(_SPEC_KEYS)}")
    sizes, options, tensors, scalars = (data[k] for k in _SPEC_KEYS)
    if not _is_shape(sizes) or not isinstance(options, list) or len(options) != len(sizes):
        raise ValueError("group_sizes and options do not describe the same groups")
    if not (isinstance(tensors, list) and isinstance(scalars, list)):
        raise ValueError("tensors and scalars must be lists")
    count = sum(sizes)
    out_tensors = []
    for item in tensors:
        i, key, shape, dtype, device = _entry(item, 5, count, "tensor entry")
        if not (_is_shape(shape) and dtype in _DTYPES and isinstance(device, str)):
            raise ValueError(f"tensor entry {key!r} of parameter {i} is malformed")
        out_tensors.append((i, key, tuple(shape), _DTYPES[dtype], device))
    out_options = []
    for g, group in enumerate(options):
        if not isinstance(group, dict):
            raise ValueError(f"the options of group {g} are not an object")
        out_options.append(
            {k: value_from_json(v, f"option {k!r} of group {g}") for k, v in group.items()}
        )
    out_scalars = []
    for item in scalars:
        i, key, value = _entry(item, 3, count, "scalar entry")
        out_scalars.append((i, key, value_from_json(value, f"state {key!r} of parameter {i}")))
    return StateSpec(
        group_sizes=sizes, options=out_options, tensors=out_tensors, scalars=out_scalars
    )


def _send_spec(optimizer: torch.optim.Optimizer, root_rank: int) -> StateSpec:
    """The root's layout on every rank, as JSON; a root that cannot describe it fails everywhere."""
    s = session()
    payload: dict[str, Any] | None = None
    if s.topology.rank == root_rank:
        try:
            payload = {"spec": spec_to_json(describe_state(optimizer))}
        except _Unsendable as exc:
            payload = {"unsendable": str(exc)}
    agree(
        "broadcast", None, key=(_OPERATION, root_rank), desc=f"{_OPERATION}(root_rank={root_rank})"
    )
    got = broadcast_json(payload, root_rank, operation=_OPERATION, timeout_s=s.timeout_s)
    if isinstance(got, dict) and isinstance(got.get("unsendable"), str) and len(got) == 1:
        raise UsageError(
            f"rank {s.topology.rank}: {_OPERATION}: on rank {root_rank}, "
            f"{got['unsendable'][:200]}, which is not sent (numbers, strings, booleans, "
            "None, lists, tuples, dicts and tensors are); keep such values out of the "
            "optimizer's state and param_groups"
        )
    try:
        if not (isinstance(got, dict) and set(got) == {"spec"}):
            raise ValueError("expected an object with the layout")
        return spec_from_json(got["spec"])
    except ValueError as exc:
        raise PayloadError(s.topology.rank, _OPERATION, root_rank, str(exc)) from None


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
    check_root(root_rank, _OPERATION)
    named = apply_spec(optimizer, _send_spec(optimizer, root_rank))
    broadcast_tensors(named, root_rank, _OPERATION)
