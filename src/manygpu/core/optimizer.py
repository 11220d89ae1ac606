"""An optimizer that knows about accumulation and loss scaling."""

from __future__ import annotations

from typing import Any

import torch

from manygpu.core.accumulation import Accumulator
from manygpu.core.precision import PrecisionPlugin


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; ``step``/``zero_grad`` act only on sync steps.

    Subclassing ``Optimizer`` (without its ``__init__``) keeps LR schedulers and
    ``isinstance`` checks working; all state lives in the wrapped optimizer.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, accumulator: Accumulator, precision: PrecisionPlugin
    ) -> None:
        # Deliberately no super().__init__: this object owns no parameters.
        self.optimizer = optimizer
        self._accumulator = accumulator
        self._precision = precision

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Apply the update at the end of an accumulation cycle; else do nothing."""
        if closure is not None:
            raise ValueError("closures are not supported by manygpu's prepared optimizer")
        if self._accumulator.last_synced:
            self._precision.step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, except while still accumulating them."""
        if self._accumulator.last_synced:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"
