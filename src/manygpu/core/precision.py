"""Mixed precision: autocast for the forward, a grad scaler for fp16."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionPlugin:
    """Owns the autocast dtype and, for fp16, the loss scaler."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.precision = precision
        self.device = device
        self.dtype = _DTYPES.get(precision)
        # fp16's narrow exponent underflows small gradients; bf16 has fp32's
        # range and needs no scaling.
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self._update_pending = False

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the enclosed ops in the chosen low precision (no-op for fp32)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield

    def wrap_forward(self, module: torch.nn.Module) -> None:
        """Make ``module(...)`` run under autocast without the user writing it.

        Patched on the instance (like Accelerate) so state-dict keys stay the same.
        """
        if self.dtype is None:
            return
        forward: Callable[..., Any] = module.forward

        @functools.wraps(forward)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with self.autocast():
                return forward(*args, **kwargs)

        module.forward = autocast_forward

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss
        if self._update_pending:
            # Once per cycle, after every optimizer stepped (GANs have several):
            # update() resets all optimizers' unscale state.
            self.scaler.update()
            self._update_pending = False
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to true scale (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step; with a scaler, skipped on inf/nan and the scale updated."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self._update_pending = True
