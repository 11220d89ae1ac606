"""``"model"``: one process, the layers of a model spread over several devices.

The classic recipe ("layer 1 on cuda:0, layer 2 on cuda:1"): an
``nn.Sequential`` is cut into contiguous stages balanced by parameter count,
each stage lives on its device, and each stage's input is moved to that device
by a forward pre-hook, so the user's forward needs no ``.to()`` calls. Only
one device works at a time (see ``"pipeline"`` for overlap). On CPU every
stage is on the CPU, so the code path is testable anywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from manygpu.core.data import move_to_device
from manygpu.errors import UsageError
from manygpu.runtime.cluster import ClusterInfo
from manygpu.strategies.base import Strategy, StrategyOptions
from manygpu.strategies.registry import register
from manygpu.strategies.splitting import balanced_cuts, param_sizes


def _stage_devices(count: int) -> list[torch.device]:
    """One GPU per stage, round-robin when stages outnumber GPUs (one GPU: all on it)."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        return [torch.device("cuda", i % gpus) for i in range(count)]
    return [torch.device("cpu")] * count


@register("model")
class ModelParallelStrategy(Strategy):
    """Split an ``nn.Sequential`` over the visible devices (2 CPU stages without GPUs)."""

    multi_process = False

    @classmethod
    def validate_world(cls, cluster: ClusterInfo, options: StrategyOptions) -> None:
        super().validate_world(cluster, options)
        if cluster.world_size > 1:
            raise UsageError(
                "strategy 'model' splits one process's model over its devices; launch one "
                "process (use 'pipeline' for one stage per process)"
            )

    def setup_module(self, module: nn.Module) -> nn.Module:
        if not isinstance(module, nn.Sequential):
            raise UsageError(
                "strategy 'model' splits an nn.Sequential; wrap your layers in one, "
                f"not a {type(module).__name__}"
            )
        stages = self.options.model_stages or max(
            2, torch.cuda.device_count() if torch.cuda.is_available() else 2
        )
        starts = balanced_cuts(param_sizes(module), stages)
        devices = _stage_devices(len(starts))
        bounds = [*starts, len(module)]
        for stage, device in enumerate(devices):
            for layer in list(module)[bounds[stage] : bounds[stage + 1]]:
                layer.to(device)
            first = module[bounds[stage]]
            first.register_forward_pre_hook(_move_inputs(device))
        module.stage_starts = starts  # type: ignore[assignment]
        module.stage_devices = devices  # type: ignore[assignment]
        return module


def _move_inputs(device: torch.device) -> Any:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(move_to_device(a, device) for a in args)

    return hook
