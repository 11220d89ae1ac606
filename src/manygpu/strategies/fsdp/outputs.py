"""An FSDP2 unit hands back tensors of its own, not views.

FSDP2 hooks each unit's outputs to gather the unit's parameters again for
backward, and warns when an output is a view: an in-place op on a view would
drop that hook. Ordinary layers return views without any in-place op in the
model: ``nn.Linear`` with a bias on a 3-D input (CPU) reshapes its ``addmm``
result, and a tensor-parallel layer's output comes through
``DTensor.to_local()``, an alias of its shard. So FSDP2 warned on every rank
and step of a plain ``mesh={"dp": 2, "tp": 2}`` run. The alias is the cause:
each unit's outputs go through :class:`_Unview`, the same storage as a tensor of
its own (no copy; gradients pass through unchanged), so an in-place op on it is
safe and FSDP2 has nothing to warn about.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map


class _Unview(torch.autograd.Function):
    """Identity whose output is not a view: ``detach`` shares the storage (and its
    version counter, so autograd still catches a modified saved tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _unview(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value._base is not None and value.requires_grad:
        return _Unview.apply(value)
    return value


def _unviewed(module: nn.Module, inputs: Any, output: Any) -> Any:
    return tree_map(_unview, output)


def unview_outputs(unit: nn.Module) -> None:
    """Before FSDP2's own post-forward hook (``prepend``): ``unit``'s outputs unviewed."""
    unit.register_forward_hook(_unviewed, prepend=True)
