"""What a strategy costs, as data: which state it splits, and what it sends per step.

Each registered strategy carries one :class:`MemoryModel` and one
:class:`CommModel` (see :mod:`.registry`). The planner (:mod:`manygpu.plan`)
turns them into bytes and seconds with one formula for every strategy, so a
new strategy brings its costs with it instead of new branches in the planner.
Plain data, no torch: the planner imports it without any strategy's engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Split = Literal["whole", "world", "ways"]
"""How a piece of state is divided on one device: not at all, over every
data-parallel rank (ZeRO / FSDP), or over the model-split ways (pipeline stages,
tensor shards, model-parallel devices)."""


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Where a strategy keeps the fp32 parameters, gradients and optimizer state
    that manygpu allocates (mixed precision is autocast over fp32 weights), and
    which extra whole copies of the weights it holds during a step."""

    weights: Split = "whole"
    """The fp32 parameters held between steps (FSDP2: the sharded ones)."""
    grads: Split = "whole"
    optimizer: Split = "whole"
    """Optimizer state (Adam's moments): fp32, like the parameters it updates."""
    activations: Literal["whole", "ways", "in_flight", "tp_sharded"] = "whole"
    """``in_flight``: a 1F1B pipeline keeps at most ``stages`` micro-batches alive;
    ``tp_sharded``: the activations of tensor-parallel layers are split over the ways."""
    gathered: Literal["none", "unit", "whole"] = "none"
    """Unsharded parameters held during a step: none, one unit and the prefetched
    next one (FSDP2 resharding after forward), or every unit from its forward to
    its backward (ZeRO-2's ``reshard_after_forward=False``)."""
    experts: Split | None = None
    """Where a mixture of experts' expert parameters (and their gradients and
    optimizer state) live when not as the rest: ``ways`` under expert
    parallelism (``num_experts / ep`` experts per device); ``None``: like the
    other parameters. A strategy that sets it is a candidate for MoE models only."""
    compute_dtype_option: str = ""
    """The option of the strategy's object that gathers parameters in the compute
    dtype (FSDP2's ``param_dtype``): the planner sets it under 16-bit precision,
    so gathered copies take 2 bytes and autocast casts no weights."""


@dataclass(frozen=True, kw_only=True)
class CommModel:
    """The collectives of one training step."""

    replica: Literal["one_process", "device", "ways"] = "device"
    """What holds one model replica: one process over all its devices (single,
    model), one device (data parallelism), or ``ways`` devices (pipeline, tensor)."""
    grads: Literal["none", "all_reduce", "reduce_scatter", "push_pull"] = "all_reduce"
    """How gradients are combined over the data-parallel ranks: in buckets by a
    collective, or (``push_pull``) pushed whole to parameter servers after the
    backward, which send the updated weights back (``ways`` = servers)."""
    weight_gathers: int = 0
    """All-gathers of the weights per step: before forward (1), again before backward (2)."""
    gather_after_step: bool = False
    """ZeRO-1: the updated optimizer shards are gathered back into whole weights."""
    split: Literal["none", "stages", "layer_shards"] = "none"
    """Inside a replica: consecutive stages (a pipeline's bubble), or every layer
    sharded (tensor parallelism's per-layer all-reduces)."""
    token_all_to_alls: int = 0
    """All-to-alls of each MoE layer's routed tokens per step over the ways
    (expert parallelism: dispatch and combine, in forward and in backward: 4);
    its expert gradients are then reduced over the ``world / ways`` replicas only."""
