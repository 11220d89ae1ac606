"""``DistributedDataParallel``: one process per device, gradients all-reduced."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from manygpu.errors import UsageError
from manygpu.strategies.abilities import CommProbe
from manygpu.strategies.base import Strategy
from manygpu.strategies.ddp import DDP
from manygpu.strategies.options import CompileOptions, compile_in_place
from manygpu.transforms.fp8 import TrainsFp8
from manygpu.transforms.materialize import Place

_HOOKS = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


def _buffer_sync_kwarg(enabled: bool) -> dict[str, Any]:
    """torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers``; older has the old."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {name: enabled}


class DDPStrategy(Strategy[DDP], TrainsFp8):
    """Replicate the model on every rank; DDP overlaps all-reduce with backward."""

    spec_class = DDP

    needs_process_group = True
    shards_data = True

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        opts = self.options
        if opts.grad_compression == "bf16" and self.ctx.backend != "nccl":
            raise UsageError(
                "grad_compression='bf16' needs the NCCL backend (CUDA GPUs); "
                "use grad_compression='fp16' with gloo"
            )
        module = place(module, self.ctx.device)
        if opts.sync_batchnorm:
            module = _sync_batchnorm(module, self.ctx.device)
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        ddp = DistributedDataParallel(
            module,
            device_ids=device_ids,
            bucket_cap_mb=opts.bucket_cap_mb,
            find_unused_parameters=opts.find_unused_parameters,
            static_graph=opts.static_graph,
            **_buffer_sync_kwarg(opts.sync_buffers),
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
        )
        if opts.grad_compression != "none":
            ddp.register_comm_hook(state=None, hook=_HOOKS[opts.grad_compression])
        return ddp

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        # What ``no_sync()`` toggles; setting it directly lets accumulation work
        # without the user wrapping forward *and* backward in a context.
        if isinstance(module, DistributedDataParallel):
            module.require_backward_grad_sync = enabled

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def comm_probe(self, module: nn.Module, every: int) -> CommProbe | None:
        """DDP's reducer times its own steps (every 100th by default): every ``every``-th here."""
        if not isinstance(module, DistributedDataParallel):
            return None
        module._set_ddp_runtime_logging_sample_rate(every)
        return _ReducerTimes(module)

    def compile_module(self, module: nn.Module, options: CompileOptions) -> None:
        """Compile the model inside the DDP wrapper, after wrapping.

        DDP's own forward (bucket bookkeeping) stays eager; the model's code is
        compiled while DDP is active, so torch's DDPOptimizer splits its graph
        at the gradient buckets and their all-reduces still overlap the
        backward. Compiling the wrapper itself would break the graph in DDP's
        forward, which ``fullgraph=True`` refuses.
        """
        compile_in_place(self.unwrap(module), options)


class _ReducerTimes:
    """Exposed communication of DDP's latest sampled step, from its reducer's timers.

    The reducer notes when the backward's last gradient was ready and when the
    last bucket's all-reduce finished; what lies between is the communication
    the backward did not hide. A slow rank's is short, its peers' long.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._ddp = ddp
        self._seen: int | None = None

    def __call__(self) -> tuple[int, float] | None:
        data = self._ddp._get_ddp_logging_data()
        started = data.get("forward_compute_time_start")
        ready, done = data.get("backward_compute_time_end"), data.get("backward_comm_time_end")
        if not started or started == self._seen or not ready or not done:
            return None
        self._seen = started
        return int(started), max(0, int(done) - int(ready)) / 1e9


def _sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """BatchNorm layers as ``SyncBatchNorm`` (same parameters), refused where torch has none."""
    if device.type != "cuda":
        raise UsageError(
            "DDP(sync_batchnorm=True) needs CUDA devices (torch's SyncBatchNorm has no "
            "CPU kernel); on CPU leave it off: each rank then normalises by its own batch"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(module)
