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
    """The unit's output with each tensor unviewed: a tensor, or one in a tuple (named
    too), list or dict (a Hugging Face ``ModelOutput`` is one, changed in place so it
    keeps its class and attributes); other objects are left as they are."""
    if isinstance(output, dict):
        for key, value in list(output.items()):
            new = _unviewed(module, inputs, value)
            if new is not value:
                output[key] = new
        return output
    if isinstance(output, tuple | list):
        items = [_unviewed(module, inputs, o) for o in output]
        if hasattr(output, "_fields"):  # a namedtuple takes its fields one by one
            return type(output)(*items)
        return type(output)(items)
    return _unview(output)


def unview_outputs(unit: nn.Module) -> None:
    """``unit``'s outputs unviewed, called before ``fully_shard``: after the hooks the
    unit already has (a tensor-parallel layer's ``to_local``, the alias to undo) and
    before the post-forward hook FSDP2 adds next."""
    unit.register_forward_hook(_unviewed)
