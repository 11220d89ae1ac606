"""What activation checkpointing saves in memory and costs in compute, per model.

``Parallel(activation_checkpointing=...)`` (:mod:`manygpu.transforms.checkpointing`)
checkpoints the model's blocks. The planner counts it from four numbers of a
:class:`~manygpu.plan.desc.ModelDesc`, measured on a real model by
:func:`measure_blocks` or derived from a transformer's shape:

- the bytes autograd saves inside the blocks (``block_activation_bytes``);
- the blocks' inputs, which a checkpointed block keeps (``block_input_bytes``);
- the outputs of the ops ``"selective"`` keeps (matmuls, attention), which it
  saves instead of recomputing (``block_kept_bytes``);
- the FLOPs inside the blocks, a third of which (the forward) ``"full"`` runs
  again in the backward.

Kept after the forward, per checkpointed fraction ``f`` of the blocks:
``activations - f x block_activations + f x inputs`` (+ ``f x kept`` for
``"selective"``); during the backward one block at a time is rematerialised,
which adds one block's recomputed activations to the peak. ``"selective"``
recomputes only norms, activations and element-wise ops: no FLOPs in this
model (they are memory-bound; a few per cent of a step in practice, not counted).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manygpu.errors import UsageError

if TYPE_CHECKING:
    from manygpu.plan.desc import ModelDesc

MODES = ("selective", "full")
"""What the planner tries, cheapest recompute first, when a strategy does not fit."""


@dataclass(frozen=True, kw_only=True)
class Recompute:
    """One checkpointing choice on one model: memory kept, peak, and extra compute."""

    mode: str
    kept_bytes_per_sample: float
    """Activations alive after the forward (fp32), what the backward starts from."""
    peak_bytes_per_sample: float
    """Kept plus the one block being recomputed during the backward."""
    extra_compute: float
    """Recomputation as a fraction of the step's compute (0.2: 20% more)."""


def fraction(desc: ModelDesc, every: int) -> float:
    """The share of the blocks that every ``every``-th checkpoints (blocks 0, N, 2N...)."""
    if desc.blocks < 1:
        return 1.0 / every
    return math.ceil(desc.blocks / every) / desc.blocks


def knows_blocks(desc: ModelDesc) -> bool:
    """Whether ``desc`` says enough of its blocks to count checkpointing."""
    return desc.block_activation_bytes_per_sample > 0


def cost(desc: ModelDesc, mode: str | int) -> Recompute:
    """``mode`` (``"full"``, ``"selective"`` or every N-th block) on ``desc``."""
    if not knows_blocks(desc):
        raise UsageError(
            f"model {desc.name!r}: its blocks' activations are unknown, so checkpointing "
            "cannot be counted; give a transformer's --layers/--hidden/--seq or a --model"
        )
    every = 1 if isinstance(mode, str) else int(mode)
    f = fraction(desc, every)
    block = desc.block_activation_bytes_per_sample
    kept_inside = desc.block_kept_bytes_per_sample if mode == "selective" else 0.0
    kept = (
        desc.activation_bytes_per_sample
        - f * block
        + f * (desc.block_input_bytes_per_sample + kept_inside)
    )
    one_block = (block - kept_inside) / max(desc.blocks, 1)
    peak = kept + one_block
    share = desc.block_flops_per_sample / desc.flops_per_sample if desc.flops_per_sample else 1.0
    extra = 0.0 if mode == "selective" else f * share / 3.0
    label = mode if isinstance(mode, str) else f"every {every}"
    return Recompute(
        mode=label,
        kept_bytes_per_sample=kept,
        peak_bytes_per_sample=peak,
        extra_compute=extra,
    )


def applied(desc: ModelDesc, mode: str | int | None) -> ModelDesc:
    """``desc`` with the activations it keeps under ``mode`` (``None``: as it is);
    the tensor-parallel share shrinks in proportion."""
    if mode is None:
        return desc
    acts = cost(desc, mode).peak_bytes_per_sample
    ratio = acts / desc.activation_bytes_per_sample
    return replace(
        desc,
        activation_bytes_per_sample=acts,
        tp_sharded_activation_bytes_per_sample=desc.tp_sharded_activation_bytes_per_sample * ratio,
    )


@dataclass(frozen=True, kw_only=True)
class BlockBytes:
    """What :func:`measure_blocks` found, for one batch (divide by the batch)."""

    blocks: int
    activation_bytes: int
    input_bytes: int
    kept_bytes: int


def measure_blocks(
    model: nn.Module, x: torch.Tensor, loss: Callable[..., torch.Tensor], y: torch.Tensor
) -> BlockBytes:
    """Saved-for-backward bytes inside the model's blocks (as checkpointing finds
    them), their inputs, and the outputs of the ops ``"selective"`` keeps."""
    from manygpu.transforms.blocks import checkpoint_blocks_of
    from manygpu.transforms.checkpointing import SAVED_OPS

    blocks = checkpoint_blocks_of(model)
    tally = _Tally(SAVED_OPS, {p.data_ptr() for p in model.parameters()})
    handles = []
    for block in blocks:
        handles.append(block.register_forward_pre_hook(tally.enter, with_kwargs=True))
        handles.append(block.register_forward_hook(tally.leave, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(tally.pack, lambda t: t), tally:
            out = loss(model(x), y)
        out.backward()
    finally:
        for h in handles:
            h.remove()
    return BlockBytes(
        blocks=len(blocks),
        activation_bytes=sum(tally.saved.values()),
        input_bytes=sum(tally.inputs.values()),
        kept_bytes=sum(tally.kept.values()),
    )


def _key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Tally(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts, by storage, what is saved, input and kept while inside a block."""

    def __init__(self, kept_ops: frozenset[Any], params: set[int]) -> None:
        super().__init__()
        self.kept_ops, self.params = kept_ops, params
        self.depth = 0
        self.saved: dict[tuple[int, int], int] = {}
        self.inputs: dict[tuple[int, int], int] = {}
        self.kept: dict[tuple[int, int], int] = {}
        self._held: list[torch.Tensor] = []
        """The kept outputs, held until the count ends: a freed one's address would be
        reused by a later output, which would then count as the same storage."""

    def enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.depth == 0:
            for t in [*args, *kwargs.values()]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self.inputs[_key(t)] = t.untyped_storage().nbytes()
        self.depth += 1

    def leave(self, *_: Any) -> None:
        self.depth -= 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.depth and t.data_ptr() not in self.params:
            self.saved[_key(t)] = t.untyped_storage().nbytes()
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.depth and func in self.kept_ops:
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    self.kept[_key(t)] = t.untyped_storage().nbytes()
                    self._held.append(t)
        return out
