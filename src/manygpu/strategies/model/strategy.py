"""``"model"``: one process, the layers of a model spread over several devices.

The classic recipe ("layer 1 on cuda:0, layer 2 on cuda:1"): an
``nn.Sequential`` is cut into contiguous stages balanced by parameter count,
each stage lives on its device, and each stage's input is moved to that device
by a forward pre-hook, so the user's forward needs no ``.to()`` calls. Only
one device works at a time (see ``"pipeline"`` for overlap). On CPU every
stage is on the CPU, so the code path is testable anywhere.

With ``mesh={"dp": N}`` it is PyTorch's "DDP + model parallel" recipe: N
processes, each splitting its replica over its own devices (process r of k
stages takes local GPUs r*k .. r*k+k-1), and DDP all-reducing gradients over
the replicas (``device_ids=None``, as DDP requires for a multi-device module).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from manygpu.errors import UsageError
from manygpu.runtime.device import move_to_device
from manygpu.strategies.base import Strategy
from manygpu.strategies.model import ModelParallel
from manygpu.strategies.splitting import balanced_cuts, param_sizes
from manygpu.transforms.materialize import Place


def _stage_devices(count: int, local_rank: int = 0) -> list[torch.device]:
    """This process's GPUs, one per stage, round-robin when stages outnumber them.

    Process ``local_rank`` owns GPUs ``local_rank*count ..`` (replicas of the
    DDP + model-parallel recipe never share a device while there are enough).
    """
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        return [torch.device("cuda", (local_rank * count + i) % gpus) for i in range(count)]
    return [torch.device("cpu")] * count


class ModelParallelStrategy(Strategy[ModelParallel]):
    """Split an ``nn.Sequential`` over the visible devices (2 CPU stages without GPUs)."""

    spec_class = ModelParallel

    instead = (
        "launch one process, give mesh={'dp': -1} for DDP over model-parallel replicas, "
        "or use 'pipeline' for one stage per process"
    )

    compile_refusal = (
        "its forward hops between devices layer by layer; use strategy='pipeline' "
        "(one compiled stage per process) or compile=False"
    )

    stage_starts: list[int]
    """First layer of each stage (after ``setup_module``)."""
    stage_devices: list[torch.device]
    """The device of each stage."""

    @property
    def _replicated(self) -> bool:
        return self.ctx.world_size > 1

    def data_shard(self) -> tuple[int, int]:
        return (self.ctx.rank, self.ctx.world_size) if self._replicated else (0, 1)

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        if not isinstance(module, nn.Sequential):
            raise UsageError(
                "strategy 'model' splits an nn.Sequential; wrap your layers in one, "
                f"not a {type(module).__name__}"
            )
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # Replicas on one node share its GPUs: each gets its own slice.
        stages = self.options.stages or max(2, gpus // self.ctx.cluster.local_world_size)
        starts = balanced_cuts(param_sizes(module), stages)
        devices = _stage_devices(len(starts), self.ctx.cluster.local_rank)
        bounds = [*starts, len(module)]
        for stage, device in enumerate(devices):
            for layer in list(module)[bounds[stage] : bounds[stage + 1]]:
                place(layer, device)
            first = module[bounds[stage]]
            first.register_forward_pre_hook(_move_inputs(device))
        self.stage_starts, self.stage_devices = starts, devices
        if not self._replicated:
            return module
        # A module on several devices: DDP takes device_ids=None and leaves
        # outputs where the last stage put them.
        return DistributedDataParallel(module, device_ids=None)

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        if isinstance(module, DistributedDataParallel):
            module.require_backward_grad_sync = enabled

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module


def _move_inputs(device: torch.device) -> Any:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(move_to_device(a, device) for a in args)

    return hook
