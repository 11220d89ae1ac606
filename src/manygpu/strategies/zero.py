"""ZeRO-1: DDP for gradients, ``ZeroRedundancyOptimizer`` for optimizer state.

Each rank keeps the optimizer state (Adam's two moments: 2x the model) for
1/N of the parameters, steps them, and broadcasts the updated slices.
"""

from __future__ import annotations

import torch

from manygpu.errors import UsageError
from manygpu.strategies.ddp import DDPStrategy
from manygpu.strategies.registry import register


@register("zero1")
class Zero1Strategy(DDPStrategy):
    """Replicated parameters and gradients, sharded optimizer state."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if len(optimizer.param_groups) != 1:
            raise UsageError(
                "strategy 'zero1' shards one parameter group; build the optimizer with a "
                "single group (per-group settings are not supported by ZeroRedundancyOptimizer)"
            )
        if optimizer.state:
            raise UsageError("strategy 'zero1' needs a fresh optimizer: prepare it before training")
        # Imported here: torch.distributed.optim pulls in TorchScript at import time.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = optimizer.param_groups[0]
        settings = {k: v for k, v in group.items() if k != "params"}
        return ZeroRedundancyOptimizer(group["params"], optimizer_class=type(optimizer), **settings)

    def consolidate_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # Each rank holds 1/N of the state; a "full" checkpoint needs all of it
        # on rank 0, where ZeroRedundancyOptimizer.state_dict() then works.
        consolidate = getattr(optimizer, "consolidate_state_dict", None)
        if consolidate is not None:
            consolidate(to=0)
