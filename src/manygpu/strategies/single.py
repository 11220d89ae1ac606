"""One process, one device: the reference every other strategy must match."""

from __future__ import annotations

from torch import nn

from manygpu.errors import UsageError
from manygpu.runtime.cluster import ClusterInfo
from manygpu.strategies.base import Strategy, StrategyOptions
from manygpu.strategies.registry import register


@register("single")
class SingleDevice(Strategy):
    """Plain training on this process's device."""

    @classmethod
    def validate_world(cls, cluster: ClusterInfo, options: StrategyOptions) -> None:
        super().validate_world(cluster, options)
        if cluster.world_size > 1:
            raise UsageError(
                f"strategy 'single' runs one process but this job has {cluster.world_size}; "
                "use strategy='ddp' or launch one process"
            )

    def setup_module(self, module: nn.Module) -> nn.Module:
        return module.to(self.ctx.device)
