"""ZeRO-1: DDP for gradients, ``ZeroRedundancyOptimizer`` for optimizer state.

Each rank keeps the optimizer state (Adam's two moments: 2x the model) for
1/N of the parameters, steps them, and broadcasts the updated slices.
"""

from __future__ import annotations

import inspect

import torch

from manygpu.errors import UsageError
from manygpu.strategies.ddp import Zero1
from manygpu.strategies.ddp.strategy import DDPStrategy


class Zero1Strategy(DDPStrategy):
    """Replicated parameters and gradients, sharded optimizer state."""

    spec_class = Zero1

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if _has_stepped(optimizer):
            raise UsageError("strategy 'zero1' needs a fresh optimizer: prepare it before training")
        # Imported here: torch.distributed.optim pulls in TorchScript at import time.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls = type(optimizer)
        accepted = _constructor_keys(cls)
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        # Param groups carry keys the constructor does not take (AdamW's
        # decoupled_weight_decay, "initial_lr" from a scheduler): keep them in
        # the groups, where the optimizer reads them, not in the constructor.
        # The group dicts themselves are shared, not copied: a scheduler attached
        # to the user's optimizer before prepare sets the lr ZeRO steps with.
        return ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=cls, **defaults)

    def consolidate_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # Each rank holds 1/N of the state; a "full" checkpoint needs all of it
        # on rank 0, where ZeroRedundancyOptimizer.state_dict() then works.
        consolidate = getattr(optimizer, "consolidate_state_dict", None)
        if consolidate is not None:
            consolidate(to=0)


def _constructor_keys(cls: type) -> set[str]:
    """Keyword arguments ``cls.__init__`` takes; defaults it does not take stay in the groups."""
    params = inspect.signature(cls).parameters.values()
    return {p.name for p in params if p.name != "params"}


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has state from a step (Adagrad's initial sums do not count)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or float(step) > 0:
            return True
    return False
