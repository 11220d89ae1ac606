"""The shared base of strategies that replace a model's parameters.

FSDP2 turns parameters into sharded DTensors, tensor parallelism into DTensor
slices, a pipeline keeps only its stage's: in each case an optimizer built
from the original parameters would train nothing. :class:`ReplacingMeshStrategy`
remembers what ``prepare`` produced and refuses such an optimizer, and turns
FSDP2's gradient sync on and off for accumulation. ``fsdp``, ``tensor``,
``pipeline`` and ``parallelize`` derive from it; the FSDP2 calls that compose
them over a mesh are in :mod:`.fsdp.sharding`.
"""

from __future__ import annotations

import torch
from torch import nn

from manygpu.errors import UsageError
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.base import JobOptions, MeshStrategy, OptionsT
from manygpu.strategies.fsdp.sharding import set_fsdp_grad_sync


class ReplacingMeshStrategy(MeshStrategy[OptionsT]):
    """A mesh strategy whose wrapping replaces parameters (FSDP2 shards, DTensors, stages)."""

    # FSDP2 refuses non-contiguous parameters ("FSDP does not support
    # non-contiguous parameters yet"): weights stay as they are, inputs go channels_last.
    channels_last_weights = False

    def __init__(self, ctx: DistContext, options: OptionsT, job: JobOptions) -> None:
        super().__init__(ctx, options, job)
        self.prepared_params: set[int] = set()
        """``id`` of every parameter of the prepared model(s)."""

    def remember_prepared(self, module: nn.Module) -> None:
        """Note the parameters the wrapper produced, to check the optimizer against them."""
        self.prepared_params |= {id(p) for p in module.parameters()}

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Refuse an optimizer that holds parameters from before the model was prepared."""
        for group in optimizer.param_groups:
            if any(id(p) not in self.prepared_params for p in group["params"]):
                raise UsageError(
                    f"strategy {self.name!r} replaces the model's parameters: create the "
                    "optimizer after model = par.prepare(model), from model.parameters()"
                )
        return optimizer

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        set_fsdp_grad_sync(module, enabled)
