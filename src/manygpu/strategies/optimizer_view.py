"""A stand-in for the user's optimizer that shows its groups, state and defaults.

Prepared optimizers subclass ``Optimizer`` without calling its ``__init__``, so
LR schedulers and ``isinstance`` checks see the user's own ``param_groups``
while ``step()`` does what the strategy needs.
"""

from __future__ import annotations

from typing import Any

import torch


class OptimizerView(torch.optim.Optimizer):
    """Delegates ``param_groups``, ``state`` and ``defaults`` to ``self.optimizer``."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults
