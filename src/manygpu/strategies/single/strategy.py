"""One process, one device: the reference every other strategy must match."""

from __future__ import annotations

from torch import nn

from manygpu.strategies.base import Strategy
from manygpu.strategies.single import Single
from manygpu.transforms.fp8 import TrainsFp8
from manygpu.transforms.materialize import Place


class SingleDevice(Strategy[Single], TrainsFp8):
    """Plain training on this process's device."""

    spec_class = Single

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        return place(module, self.ctx.device)
