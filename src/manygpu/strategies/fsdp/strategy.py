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

Parameters become DTensors sharded on dim 0; an optimizer built before
:meth:`Parallel.prepare` is rebound to them (:mod:`manygpu.core.rebind`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from manygpu.strategies.fsdp import FSDP
from manygpu.strategies.fsdp.fp8 import Fsdp2Fp8
from manygpu.strategies.fsdp.sharding import fsdp_kwargs, shard_data_dims
from manygpu.strategies.mesh import job_mesh
from manygpu.strategies.options import CompileOptions, compile_in_place
from manygpu.strategies.sharded import MeshStrategy
from manygpu.transforms.materialize import Place


class FSDPStrategy(MeshStrategy[FSDP], Fsdp2Fp8):
    """ZeRO-3 through FSDP2: every rank holds 1/N of parameters, grads and optimizer state."""

    spec_class = FSDP

    needs_process_group = True
    shards_data = True

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        opts = self.options
        names = self.mesh_names
        mesh = job_mesh(self.ctx, self.shape, names)
        kwargs = fsdp_kwargs(
            opts, self.ctx.device, reshard_after_forward=opts.reshard_after_forward
        )
        shard_data_dims(
            module,
            mesh,
            kwargs,
            children=opts.shard_children,
            block_classes=tuple(opts.block_classes),  # type: ignore[arg-type]
        )
        # Sharded first (FSDP2 moves a real model to the device unit by unit), then
        # each rank's shards allocated: a meta model is never whole anywhere.
        return place(module, torch.device("cpu") if opts.cpu_offload else self.ctx.device)

    def compile_module(self, module: nn.Module, options: CompileOptions) -> None:
        """Each FSDP2 unit (a block) compiled on its own, then the root.

        A block is one graph between its all-gather and its reduce-scatter
        hooks, which compiled code does not trace through. The root's graph
        (embeddings, head) breaks at those hooks, so it is compiled without
        ``fullgraph`` even when the blocks are.
        """
        for unit in module.modules():
            if unit is not module and isinstance(unit, FSDPModule):
                compile_in_place(unit, options)
        compile_in_place(module, replace(options, fullgraph=False))
