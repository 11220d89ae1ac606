"""An optimizer that knows about accumulation and loss scaling."""

from __future__ import annotations

from typing import Any

import torch

from manygpu.core.accumulation import Accumulator
from manygpu.core.precision import PrecisionPlugin
from manygpu.core.steps import StepEvents
from manygpu.strategies.optimizer_view import OptimizerView


class PreparedOptimizer(OptimizerView):
    """Wraps the user's optimizer; ``step``/``zero_grad`` act only on sync steps.

    Subclassing ``Optimizer`` (without its ``__init__``) keeps LR schedulers and
    ``isinstance`` checks working; all state lives in the wrapped optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulator: Accumulator,
        precision: PrecisionPlugin,
        events: StepEvents | None = None,
        *,
        first: bool = True,
    ) -> None:
        # Deliberately no super().__init__: this object owns no parameters.
        self.optimizer = optimizer
        self._accumulator = accumulator
        self._precision = precision
        self._events = events if events is not None else StepEvents()
        self._first = first  # the job's training steps are the first optimizer's

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Apply the update at the end of an accumulation cycle; else do nothing."""
        if closure is not None:
            raise ValueError("closures are not supported by manygpu's prepared optimizer")
        if self._accumulator.last_synced:
            self._events.stepping(self._first)
            self._precision.step(self.optimizer)
            self._events.stepped(self._first)

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

    # Hooks live on the wrapped optimizer, whose step() is the one that runs.
    def register_step_pre_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"
