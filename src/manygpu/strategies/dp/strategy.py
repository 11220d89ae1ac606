"""``nn.DataParallel``: one process driving every visible GPU.

Kept because the classic tutorials use it. It is slower than DDP (one Python
thread scatters inputs and gathers outputs; the replicas are rebuilt every
step), so we say so once.
"""

from __future__ import annotations

import torch
from torch import nn

from manygpu.strategies.base import Strategy
from manygpu.strategies.dp import DataParallel
from manygpu.transforms.materialize import Place
from manygpu.warn import warn_user


class DataParallelStrategy(Strategy[DataParallel]):
    """Single-process data parallelism over all visible GPUs."""

    spec_class = DataParallel

    instead = "use strategy='ddp' (nn.DataParallel is the one-process way)"
    compile_refusal = (
        "nn.DataParallel rebuilds its replicas every step; use strategy='ddp' "
        "(`manygpu launch script.py`), which compiles after wrapping"
    )

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        warn_user(
            "strategy 'dp' (nn.DataParallel) is kept for old scripts; 'ddp' is faster even "
            "on one machine: run `manygpu launch script.py` with strategy='ddp'"
        )
        module = place(module, self.ctx.device)
        if self.ctx.device.type == "cuda":
            ids = list(range(torch.cuda.device_count()))
            return nn.DataParallel(module, device_ids=ids, output_device=self.ctx.device)
        # On the CPU DataParallel has nothing to split over (and, where GPUs
        # exist, would move the inputs to them): the module runs as it is.
        return module

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, nn.DataParallel) else module
