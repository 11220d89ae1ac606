"""``par.clip_grad_norm_``: clip by the whole model's gradient norm, whatever the strategy.

The norm is the model's, not this rank's part of it: shards (FSDP, tensor
parallel) and pipeline stages contribute their pieces, so every strategy
clips exactly as one process would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from manygpu.comm.common import raise_peer_failure
from manygpu.comm.grad_norm import clip_grads_, total_grad_norm
from manygpu.core.optimizer import PreparedOptimizer
from manygpu.core.precision import PrecisionPlugin
from manygpu.strategies import Strategy, abilities
from manygpu.warn import warn_user


def clip_grad_norm(
    strategy: Strategy[Any],
    params: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    *,
    synced: bool,
    optimizers: Sequence[PreparedOptimizer],
    precision: PrecisionPlugin,
    device: torch.device,
    timeout_s: float,
    rank: int,
    world_size: int,
) -> torch.Tensor:
    """Clip ``params``' gradients to ``max_norm``; returns the total (unscaled) norm.

    ``synced``: whether the last backward ended an accumulation cycle; mid-cycle
    the gradients are partial (and scaled), so nothing is clipped then.
    """
    if not synced:
        # Clipping or unscaling now would corrupt the sum still being accumulated.
        warn_user(
            "clip_grad_norm_ called on a micro-step that does not step the optimizer; "
            "call it only when par.sync_gradients is True (skipped)"
        )
        return torch.zeros((), device=device)
    combined = abilities.combined_clip(strategy, list(params), max_norm, norm_type)
    if combined is not None:  # clipped where the gradients are combined
        return combined
    owned = {id(p) for p in params}
    for opt in optimizers:
        if any(id(p) in owned for g in opt.param_groups for p in g["params"]):
            precision.unscale(opt.optimizer)
    try:
        norm = total_grad_norm(
            params,
            norm_type,
            device=device,
            across=abilities.grad_norm_group(strategy),
            timeout_s=timeout_s,
        )
    except RuntimeError as exc:
        raise_peer_failure(
            exc, rank=rank, world_size=world_size, timeout_s=timeout_s,
            operation="gradient-norm all-reduce in clip_grad_norm_",
        )  # fmt: skip
        raise
    clip_grads_(params, max_norm, norm)
    return norm
