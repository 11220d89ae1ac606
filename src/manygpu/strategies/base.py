"""The interface every strategy implements, and nothing more.

A strategy decides how a model is wrapped, how gradients are synchronised and
how data is split; the :class:`~manygpu.Parallel` object calls it and never
asks which strategy it is talking to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.options import DDPOptions, FSDPOptions


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """All strategy knobs; each strategy reads the part it owns."""

    ddp: DDPOptions = field(default_factory=DDPOptions)
    """Used by ``"ddp"`` and ``"zero1"``."""
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    """Used by ``"fsdp"`` and ``"zero2"``."""
    model_stages: int | None = None
    """Used by ``"model"``: how many devices to split over (default: all GPUs, or 2)."""


class Strategy(ABC):
    """How one process takes part in training."""

    name: ClassVar[str]
    """Registry name, e.g. ``"ddp"``."""
    needs_process_group: ClassVar[bool] = False
    """Create a group even for one process (DDP cannot work without one)."""
    shards_data: ClassVar[bool] = False
    """Whether each rank sees a different part of the data."""
    checkpoint_format: ClassVar[str] = "full"
    """``"full"`` (main rank writes one copy: replicated state) or ``"dcp"`` (sharded)."""
    multi_process: ClassVar[bool] = True
    """Whether a job of this strategy runs one process per device (else one in all)."""

    def __init__(self, ctx: DistContext, options: StrategyOptions) -> None:
        self.ctx = ctx
        self.options = options

    @classmethod
    def validate_world(cls, cluster: ClusterInfo) -> None:
        """Raise :class:`~manygpu.errors.UsageError` if this job shape cannot work."""

    @abstractmethod
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to the device and wrap it for this strategy."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adapt the optimizer (sharded strategies replace it); default: as is."""
        return optimizer

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        """Turn gradient synchronisation for the *next* forward/backward on or off.

        Used for gradient accumulation; strategies without sync ignore it.
        """

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper we added."""
        return module

    def teardown(self) -> None:
        """Release what the strategy holds (hooks, groups)."""
