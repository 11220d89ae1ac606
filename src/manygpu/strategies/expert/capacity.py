"""Expert capacity: each expert takes at most ``C`` routed copies of a batch, as one process.

In one process a batch of ``T`` tokens routed top-``k`` over ``E`` experts with
capacity factor ``f`` gives each expert ``C = ceil(f * T * k / E)`` places; the
copies take them in the batch's order (token by token, each token's ``k``
choices in order) and a copy past its expert's ``C``-th is dropped (its token
keeps only what the rest of the block adds, the residual). Under data
parallelism - expert parallelism's "dp2ep" - each rank sees ``1/R`` of the
batch: left to itself it would compute ``C`` from its own tokens and keep its
own first copies, which is not what one process does.

"As in one process on the same global batch" here means: the global batch is
the data ranks' batches one after another in rank order (how a loader's shards
concatenate); ``C`` comes from the global token count, and a rank's copy for
expert ``e`` is kept when fewer than ``C`` copies went to ``e`` before it - on
lower ranks (from the per-expert counts every rank gathers, ``E + 1`` integers
each) and earlier on this rank. Each rank then drops exactly the copies one
process would drop from its part of the batch. Under gradient accumulation
the global batch is one micro-step's.

A model uses :class:`Capacity` where it computes its drops (``keep =
self.capacity(top_k_index)``); ``ExpertParallel`` points every ``Capacity`` at
the data ranks' group, and a block with a ``capacity_factor`` of its own
(computed from its rank's tokens alone) is refused at ``prepare``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def capacity(factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """``ceil(factor * tokens * top_k / num_experts)``: copies one expert may take."""
    return math.ceil(factor * tokens * top_k / num_experts)


def keep_mask(
    choices: torch.Tensor, before: torch.Tensor, places: int, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Which copies are kept: ``choices`` (flat expert ids in batch order), ``before[e]``
    copies already given to expert ``e`` earlier in the global batch, ``places`` each;
    ``counts``: ``choices``' copies per expert, when the caller has them already."""
    if counts is None:
        counts = torch.bincount(choices, minlength=before.numel())
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(choices, stable=True)
    position = torch.empty_like(choices)
    position[order] = torch.arange(choices.numel(), device=choices.device) - starts[choices[order]]
    return before[choices] + position < places


def earlier_and_total(
    counts: torch.Tensor, tokens: int, data_rank: int, group: Any
) -> tuple[torch.Tensor, int]:
    """Copies per expert on the data ranks before ``data_rank``, and the global token
    count (every rank of ``group`` calls it; each is one data rank)."""
    mine = torch.cat([counts, counts.new_tensor([tokens, data_rank])])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every)
    earlier = table[table[:, -1] < data_rank]
    return earlier[:, :-2].sum(0), int(table[:, -2].sum())


class Capacity(nn.Module):
    """``keep = capacity(top_k_index)``: the copies one process on the global batch keeps."""

    def __init__(self, capacity_factor: float, num_experts: int) -> None:
        super().__init__()
        self.capacity_factor, self.num_experts = capacity_factor, num_experts
        self.group: Any = None
        """The data ranks' group (set by ``ExpertParallel``); ``None``: this batch alone."""
        self.data_rank = 0
        """This rank's place in the global batch (set with ``group``)."""

    def extra_repr(self) -> str:
        return f"capacity_factor={self.capacity_factor}, num_experts={self.num_experts}"

    @torch.no_grad()
    def forward(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """A bool tensor shaped like ``top_k_index`` ([tokens, k]): copies kept."""
        choices = top_k_index.reshape(-1)
        tokens, top_k = top_k_index.shape[0], top_k_index.shape[-1]
        counts = torch.bincount(choices, minlength=self.num_experts)
        before, total = torch.zeros_like(counts), tokens
        if self.group is not None:
            before, total = earlier_and_total(counts, tokens, self.data_rank, self.group)
        places = capacity(self.capacity_factor, total, top_k, self.num_experts)
        return keep_mask(choices, before, places, counts).view_as(top_k_index)
