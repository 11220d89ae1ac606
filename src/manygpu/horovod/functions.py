"""Starting every rank from the same state: parameters, optimizer state, Python objects.

``broadcast_parameters`` and ``broadcast_optimizer_state`` are what a Horovod
script calls after building its model and optimizer, so that ranks that drew
different random weights start identical. The tensors go in one broadcast per
(device, dtype) rather than one per tensor, after one check that every rank
passes the same names, shapes and dtypes (a difference is an error naming the
ranks and the tensors, not a hang).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from manygpu.comm.common import active
from manygpu.comm.objects import all_gather_object
from manygpu.comm.objects import broadcast_object as comm_broadcast_object
from manygpu.errors import UsageError
from manygpu.horovod.checks import agree
from manygpu.horovod.data_ops import check_root
from manygpu.horovod.pending import Pending, wait_pending
from manygpu.horovod.process_sets import global_process_set, resolve
from manygpu.horovod.reports import Entry


def _named(params: object) -> list[tuple[str, torch.Tensor]]:
    """``state_dict()``, ``named_parameters()``, ``parameters()`` or a list, as (name, tensor)."""
    if isinstance(params, torch.Tensor):
        raise UsageError(
            "broadcast_parameters takes a state_dict or (named) parameters, not a tensor"
        )
    if isinstance(params, Mapping):
        items: list[Any] = sorted(params.items())  # Horovod's order for dicts
    elif isinstance(params, Iterable):
        items = list(params)
    else:
        raise UsageError(
            f"broadcast_parameters: invalid params of type {type(params).__name__}; pass "
            "model.state_dict(), model.named_parameters() or model.parameters()"
        )
    out = []
    for i, item in enumerate(items):
        name, tensor = item if isinstance(item, tuple) else (f"#{i}", item)
        if not isinstance(tensor, torch.Tensor):
            raise UsageError(
                f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        out.append((str(name), tensor))
    return out


def broadcast_tensors(named: list[tuple[str, torch.Tensor]], root_rank: int, what: str) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, one broadcast per (device, dtype)."""
    check_root(root_rank, what)
    layout: list[Entry] = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    desc = f"{what}({len(named)} tensors, root_rank={root_rank})"
    seq = agree("broadcast", None, key=(what, root_rank, layout), desc=desc, details=layout)
    if not active() or not named:
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, tensor in named:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor.detach())
    flats, works = [], []
    for tensors in groups.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        flats.append((tensors, flat))
        works.append(dist.broadcast(flat, src=root_rank, async_op=True))
    wait_pending(Pending(works=works, finish=lambda: None, description=desc, seq=seq))
    with torch.no_grad():
        for tensors, flat in flats:
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_parameters(params: object, root_rank: int) -> None:
    """Make every rank's parameters (or buffers) equal to ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()`` (buffers included), ``model.named_parameters()``,
            ``model.parameters()`` or a list of tensors.
        root_rank: the rank whose values everyone gets.
    """
    broadcast_tensors(_named(params), root_rank, "broadcast_parameters")


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: object = global_process_set
) -> Any:
    """``root_rank``'s ``obj`` on every rank, pickled as in Horovod.

    Pickle trusts the sender: whatever arrives is unpickled, so any job member
    (or anything that can inject bytes into the job's traffic) can run code in
    the receiving ranks. Use it only for your own objects inside your own job;
    manygpu's own metadata travels as JSON instead.
    """
    scope = resolve(process_set, "broadcast_object")
    check_root(root_rank, "broadcast_object", scope)
    desc = f"broadcast_object({name or type(obj).__name__!r}, root_rank={root_rank})"
    key = ("broadcast_object", name, root_rank)
    agree("broadcast", None, key=key, desc=desc, name=name, scope=scope)
    if scope.whole or not active():
        return comm_broadcast_object(obj, src=root_rank)
    box = [obj]
    dist.broadcast_object_list(box, src=root_rank, group=scope.group)  # src: a global rank
    return box[0]


def allgather_object(
    obj: Any, name: str | None = None, process_set: object = global_process_set
) -> list[Any]:
    """Every rank's (of the set) ``obj``, in rank order, pickled as in Horovod.

    Pickle trusts every sender: see :func:`broadcast_object`.
    """
    scope = resolve(process_set, "allgather_object")
    desc = f"allgather_object({name or type(obj).__name__!r})"
    agree("all_gather", None, key=("allgather_object", name), desc=desc, name=name, scope=scope)
    if scope.whole or not active():
        return all_gather_object(obj)
    out: list[Any] = [None] * scope.size
    dist.all_gather_object(out, obj, group=scope.group)
    return out
