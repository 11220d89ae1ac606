"""One process, one device: the reference every other strategy must match."""

from __future__ import annotations

from torch import nn

from manygpu.strategies.base import Strategy
from manygpu.strategies.registry import register


@register("single")
class SingleDevice(Strategy):
    """Plain training on this process's device."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        return module.to(self.ctx.device)
