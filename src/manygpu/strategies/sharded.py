"""The shared base of strategies that replace a model's parameters, and their FSDP2 calls.

FSDP2 turns parameters into sharded DTensors, tensor parallelism into DTensor
slices, a pipeline keeps only its stage's: in each case an optimizer built
from the original parameters would train nothing. :class:`ReplacingMeshStrategy`
remembers what ``prepare`` produced and refuses such an optimizer, and turns
FSDP2's gradient sync on and off for accumulation. ``fsdp``, ``tensor``,
``pipeline`` and ``parallelize`` derive from it; the FSDP2 helpers below compose
them over a mesh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from manygpu.errors import UsageError
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.base import JobOptions, MeshStrategy, OptionsT
from manygpu.strategies.fsdp import FSDP
from manygpu.strategies.fsdp.units import shard_units


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


def set_fsdp_grad_sync(module: nn.Module, enabled: bool) -> None:
    """Skip (or resume) FSDP2's gradient reduce-scatter for accumulation."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)


def fsdp_kwargs(opts: FSDP, device: torch.device, *, reshard_after_forward: bool) -> dict[str, Any]:
    """``fully_shard`` keyword arguments from our options.

    CPU offload pins host memory only with a GPU (pinning needs one); on a CPU
    job the offload path still runs, which keeps it testable here.
    """
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    dtypes = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=dtypes[opts.param_dtype], reduce_dtype=dtypes[opts.reduce_dtype]
        ),
        "offload_policy": offload if opts.cpu_offload else OffloadPolicy(),
        "reshard_after_forward": reshard_after_forward,
    }


def shard_data_dims(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    kwargs: dict[str, Any],
    *,
    children: bool,
    block_classes: tuple[Any, ...] = (),
) -> nn.Module:
    """FSDP2 over the data dimensions: each block (see :mod:`.fsdp.units`), then the root.

    With a 2-D (dp, fsdp) mesh this is HSDP (with fsdp=1, plain replication);
    with 1-D fsdp it is ZeRO-3. It works on parameters that are already
    DTensors on a ``tp`` dimension (2-D FSDP + TP), which DDP does not.
    """
    units = shard_units(module, block_classes) if children else []
    for unit in [*units, module]:
        fully_shard(unit, mesh=dp_mesh, **kwargs)
    return module
