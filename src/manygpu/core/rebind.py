"""An optimizer built before ``prepare`` trains the prepared model: its parameters rebound.

Sharding strategies replace a model's parameters (FSDP2 with sharded DTensors,
tensor parallelism with DTensor slices, a pipeline keeps only its stage's), so
an optimizer built from the model first would step tensors nobody trains. The
usual answer, "create the optimizer after prepare", breaks the five lines
``model, opt, loader = par.prepare(model, opt, loader)`` as soon as one picks
such a strategy. Instead, each prepared model's parameters are recorded by
name before and after wrapping, and an optimizer holding the old ones gets the
new ones in their place, in the *same* optimizer object and the same
``params`` lists: its class, defaults, every group's settings and membership,
and any scheduler already attached to it stay as they were. A parameter the
prepared model no longer holds on this rank (another pipeline stage's) leaves
the optimizer. An optimizer that has state already (it has stepped) is
refused: its state belongs to the old tensors.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from manygpu.errors import UsageError

_Key = tuple[int, str]  # (which prepared model, parameter name)


def _named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(remove_duplicate=False))


@dataclass
class ParameterRebinder:
    """What each prepared model's parameters were, and what they became."""

    _before: dict[int, tuple[weakref.ref[torch.Tensor], _Key]] = field(default_factory=dict)
    _after: dict[_Key, torch.Tensor] = field(default_factory=dict)
    _models: int = 0

    def before(self, model: nn.Module) -> None:
        """Record ``model``'s parameters by name, before the strategy wraps it."""
        for name, param in _named(model):
            self._before.setdefault(id(param), (weakref.ref(param), (self._models, name)))

    def after(self, prepared: nn.Module) -> None:
        """Record the parameters of the prepared (unwrapped) model under the same names."""
        for name, param in _named(prepared):
            self._after.setdefault((self._models, name), param)
        self._models += 1

    def _old_key(self, param: torch.Tensor) -> _Key | None:
        """The name ``param`` had in a prepared model, if it is one of the old parameters."""
        entry = self._before.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]

    def rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """Swap old parameters for the prepared ones in ``optimizer``, in place."""
        current = {id(p) for p in self._after.values()}
        stale = [
            p for g in optimizer.param_groups for p in g["params"]
            if id(p) not in current and self._old_key(p) is not None
        ]  # fmt: skip
        if not stale:
            return
        if any(optimizer.state.get(p) for p in stale):
            raise UsageError(
                "this optimizer has stepped on the model's parameters before prepare replaced "
                "them: prepare the model and optimizer before training"
            )
        for group in optimizer.param_groups:
            group["params"][:] = self._mapped(group["params"])

    def _mapped(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        seen: set[int] = set()
        for param in params:
            key = self._old_key(param)
            new = param if key is None else self._after.get(key)
            if new is not None and id(new) not in seen:  # tied weights: once
                seen.add(id(new))
                out.append(new)
        return out
