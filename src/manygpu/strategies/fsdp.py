"""Sharded data parallelism with FSDP2 (``fully_shard``): ZeRO-3, ZeRO-2 and HSDP.

- ``"fsdp"`` (ZeRO-3): parameters, gradients and optimizer state are sharded;
  each unit's parameters are all-gathered for its forward and again for its
  backward, then freed (``reshard_after_forward=True``).
- ``"zero2"``: the same, but gathered parameters stay until the backward
  (``reshard_after_forward=False``): less communication, more memory; gradients
  and optimizer state stay sharded, as in ZeRO-2.
- HSDP: ``mesh={"dp": nodes, "fsdp": gpus_per_node}`` shards within a node
  and replicates across nodes, so the big all-gathers stay on the fast links
  and only gradients cross the slow ones.

Parameters become DTensors sharded on dim 0; the optimizer must be created
after :meth:`Parallel.prepare` has sharded the model (or be passed to the
same ``prepare`` call, which handles models first).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from manygpu.errors import UsageError
from manygpu.strategies.base import MeshStrategy, Strategy
from manygpu.strategies.mesh import data_dims, fsdp_kwargs, shard_data_dims
from manygpu.strategies.registry import register


class ReplacingMeshStrategy(MeshStrategy):
    """A mesh strategy whose wrapping replaces parameters (FSDP2 shards, DTensors)."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return check_optimizer_after_prepare(self, optimizer)

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        set_fsdp_grad_sync(module, enabled)


@register("fsdp")
class FSDPStrategy(ReplacingMeshStrategy):
    """ZeRO-3 through FSDP2: every rank holds 1/N of parameters, grads and optimizer state."""

    needs_process_group = True
    shards_data = True
    checkpoint_format = "dcp"
    reshard_after_forward = True
    mesh_dims = ("dp", "fsdp")
    default_mesh: ClassVar[dict[str, int]] = {"fsdp": -1}

    def setup_module(self, module: nn.Module) -> nn.Module:
        opts = self.options.fsdp
        if not opts.cpu_offload:
            module = module.to(self.ctx.device)
        names = data_dims(self.spec) or ("fsdp",)
        mesh = self.spec.build(self.ctx.device.type, names)
        kwargs = fsdp_kwargs(
            opts, self.ctx.device, reshard_after_forward=self.reshard_after_forward
        )
        shard_data_dims(
            module,
            mesh,
            kwargs,
            children=opts.shard_children,
            block_classes=tuple(opts.block_classes),  # type: ignore[arg-type]
        )
        remember_sharded(self, module)
        return module


@register("zero2")
class Zero2Strategy(FSDPStrategy):
    """ZeRO-2 through FSDP2: parameters stay gathered between forward and backward."""

    reshard_after_forward = False


def remember_sharded(strategy: Strategy, module: nn.Module) -> None:
    """Note the parameters a wrapper produced, to check the optimizer against them."""
    strategy._prepared_params = {id(p) for p in module.parameters()}  # type: ignore[attr-defined]


def check_optimizer_after_prepare(
    strategy: Strategy, optimizer: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """Refuse an optimizer that holds parameters from before the model was prepared.

    Sharding and splitting replace (or drop) parameters: an optimizer built
    before holds the old tensors and would silently train nothing.
    """
    known: set[int] = getattr(strategy, "_prepared_params", set())
    for group in optimizer.param_groups:
        if any(id(p) not in known for p in group["params"]):
            raise UsageError(
                f"strategy {strategy.name!r} replaces the model's parameters: create the "
                "optimizer after model = par.prepare(model), from model.parameters()"
            )
    return optimizer


def set_fsdp_grad_sync(module: nn.Module, enabled: bool) -> None:
    """Skip (or resume) FSDP2's gradient reduce-scatter for accumulation."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
