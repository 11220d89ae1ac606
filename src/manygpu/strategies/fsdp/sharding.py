"""FSDP2 calls over a mesh's data dimensions, for every strategy that shards with it.

``fsdp`` and ``zero2`` shard the whole model with them; ``tensor`` and ``pipeline``
shard their tensor-parallel model or their stage over the mesh's data dimensions
(2-D parallelism). FSDP2 turns the parameters into DTensors sharded on dim 0.
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

from manygpu.strategies.fsdp import FSDP
from manygpu.strategies.fsdp.host import keep_host_memory_low
from manygpu.strategies.fsdp.outputs import unview_outputs
from manygpu.transforms.blocks import find_blocks


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
    """FSDP2 over the data dimensions: each block (:mod:`manygpu.transforms.blocks`), then the root.

    With a 2-D (dp, fsdp) mesh this is HSDP (with fsdp=1, plain replication);
    with 1-D fsdp it is ZeRO-3. It works on parameters that are already
    DTensors on a ``tp`` dimension (2-D FSDP + TP), which DDP does not. On a
    CPU mesh the units hold each rank's host memory to its share
    (:mod:`manygpu.strategies.fsdp.host`).
    """
    units = [*(find_blocks(module, block_classes) if children else []), module]
    for unit in units:
        unview_outputs(unit)  # before fully_shard: FSDP2's hooks see tensors, not views
        fully_shard(unit, mesh=dp_mesh, **kwargs)
    if dp_mesh.device_type == "cpu":
        keep_host_memory_low(units)
    return module
