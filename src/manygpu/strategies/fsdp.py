"""Sharded data parallelism with FSDP2 (``fully_shard``): ZeRO-3 and ZeRO-2.

- ``"fsdp"`` (ZeRO-3): parameters, gradients and optimizer state are sharded;
  each unit's parameters are all-gathered for its forward and again for its
  backward, then freed (``reshard_after_forward=True``).
- ``"zero2"``: the same, but gathered parameters stay until the backward
  (``reshard_after_forward=False``): less communication, more memory; gradients
  and optimizer state stay sharded, as in ZeRO-2.

Parameters become DTensors sharded on dim 0 over a 1-D device mesh; the
optimizer must be created after :meth:`Parallel.prepare` has sharded the model
(or be passed to the same ``prepare`` call, which handles models first).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from manygpu.errors import UsageError
from manygpu.strategies.base import Strategy
from manygpu.strategies.registry import register

_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@register("fsdp")
class FSDPStrategy(Strategy):
    """ZeRO-3 through FSDP2: every rank holds 1/N of parameters, grads and optimizer state."""

    needs_process_group = True
    shards_data = True
    checkpoint_format = "dcp"
    reshard_after_forward = True

    def setup_module(self, module: nn.Module) -> nn.Module:
        opts = self.options.fsdp
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        mp = MixedPrecisionPolicy(
            param_dtype=_DTYPES[opts.param_dtype], reduce_dtype=_DTYPES[opts.reduce_dtype]
        )
        offload = CPUOffloadPolicy() if opts.cpu_offload else OffloadPolicy()
        if not opts.cpu_offload:
            module = module.to(self.ctx.device)
        units = [c for c in module.children() if any(p.requires_grad for p in c.parameters())]
        # Children first, then the root: each child is its own all-gather unit.
        for unit in [*(units if opts.shard_children else []), module]:
            fully_shard(
                unit,
                mesh=mesh,
                mp_policy=mp,
                offload_policy=offload,
                reshard_after_forward=self.reshard_after_forward,
            )
        self._sharded_params = {id(p) for p in module.parameters()}
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # fully_shard replaces every parameter by a sharded one: an optimizer built
        # before holds the old tensors and would silently train nothing.
        known: set[int] = getattr(self, "_sharded_params", set())
        for group in optimizer.param_groups:
            if any(id(p) not in known for p in group["params"]):
                raise UsageError(
                    f"strategy {self.name!r} shards the model's parameters: create the optimizer "
                    "after model = par.prepare(model), from model.parameters()"
                )
        return optimizer

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled)


@register("zero2")
class Zero2Strategy(FSDPStrategy):
    """ZeRO-2 through FSDP2: parameters stay gathered between forward and backward."""

    reshard_after_forward = False
