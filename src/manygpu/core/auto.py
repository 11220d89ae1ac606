"""``strategy="auto"``: let the planner choose, once the model is known.

The planner (:func:`manygpu.plan.recommend.recommend`) is given the model and
this job's devices; from a bare module it can only judge memory, so "auto"
picks the simplest strategy that fits (the registry's cards rank them).
Strategies whose card says they change the training loop (a pipeline needs a
loss function, tensor parallelism a plan) are never picked silently: if only
they would fit, the error says so. Every rank must pick the same one, so the memory used is the
smallest any rank reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from manygpu import comm
from manygpu.errors import UsageError
from manygpu.strategies import card

if TYPE_CHECKING:
    from manygpu.plan.hardware import Cluster


def device_memory_gb(device: torch.device, local_world: int) -> float:
    """Memory one process may use: its GPU's, or its share of the host's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    import psutil  # the planner is loaded only by jobs that ask for "auto"

    return psutil.virtual_memory().total / 1e9 / max(1, local_world)


def job_cluster(memory_gb: float, local_world: int, world: int) -> Cluster:
    """The job as the planner sees it; only memory decides for a bare module."""
    from manygpu.plan.hardware import Cluster

    per_node = max(1, min(local_world, world))
    return Cluster(
        name="this job",
        nodes=max(1, world // per_node),
        gpus_per_node=per_node,
        memory_gb=memory_gb,
        peak_tflops=1.0,
        intra_bw_gbs=1.0,
        intra_latency_us=10.0,
        inter_bw_gbs=1.0,
        inter_latency_us=10.0,
    )


def choose_strategy(
    model: nn.Module,
    *,
    world: int,
    local_world: int,
    device: torch.device,
    precision: str,
    batch: int,
    timeout_s: float,
) -> str:
    """The planner's pick among strategies that keep the user's loop; the same on every rank."""
    from manygpu.plan.recommend import recommend

    mine = torch.tensor([device_memory_gb(device, local_world)], dtype=torch.float64)
    memory_gb = float(comm.all_reduce(mine.to(device), "min", timeout_s=timeout_s).item())
    plan = recommend(
        model,
        job_cluster(memory_gb, local_world, world),
        batch=batch,
        precision=precision,
        world_size=world,
    )
    if card(plan.strategy).changes_loop:
        raise UsageError(
            f"strategy='auto': only {plan.strategy!r} fits this model in {memory_gb:,.1f} GB "
            f"per device ({plan.reason}); choose it explicitly with its options, e.g. "
            "strategy=Pipeline(loss_fn=...)"
        )
    return plan.strategy
