"""Routed copies of tokens to the ranks that hold their experts, and back.

A rank's routed copies, sorted by global expert id, fall into ``ep`` runs:
the run for experts ``[r*L, (r+1)*L)`` (``L = num_experts / ep``) goes to ep
rank ``r``. The per-expert counts are exchanged first (an all-to-all of
``ep * L`` integers), so each rank knows how many rows it receives from whom
(uneven splits); the rows then travel with ``all_to_all_single_autograd``,
whose backward is the reverse all-to-all, so gradients for the experts reach
their owners and gradients for the inputs come home. Received rows are
source-major (source rank, then expert); the local experts want them
expert-major, hence a permutation and its inverse around the compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

LocalCompute = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""``compute(rows_by_local_expert, counts_per_local_expert)``: the local experts' output."""


@dataclass(frozen=True)
class Route:
    """How one call's rows travel, from this rank's counts and the ones it receives."""

    send: list[int]
    """Rows sent to each ep rank (this rank's copies for its experts)."""
    recv: list[int]
    """Rows received from each ep rank."""
    local_counts: list[int]
    """Rows received for each local expert, over all sources."""
    order: torch.Tensor
    """Received row indices in expert-major order (expert, then source rank)."""


def route(counts: torch.Tensor, received: torch.Tensor) -> Route:
    """The route from ``counts`` ([ep * L]: this rank's copies per global expert) and
    ``received`` ([ep, L]: copies each source sends to each local expert)."""
    ep, local = received.shape
    chunks = received.reshape(-1)
    chunk_of_row = torch.repeat_interleave(torch.arange(ep * local), chunks.cpu())
    source, expert = chunk_of_row // local, chunk_of_row % local
    order = torch.argsort(expert * ep + source, stable=True)
    return Route(
        send=counts.reshape(ep, local).sum(1).tolist(),
        recv=received.sum(1).tolist(),
        local_counts=received.sum(0).tolist(),
        order=order.to(counts.device),
    )


def exchange_counts(counts: torch.Tensor, ep: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[ep, L]``: how many copies each ep rank sends to each of this rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.reshape(ep, -1)


def _a2a(
    rows: torch.Tensor, out: list[int], into: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    moved = all_to_all_single_autograd(rows.contiguous(), out, into, group)
    # A functional collective returns a tensor whose wait is deferred to first use.
    return torch.ops._c10d_functional.wait_tensor(moved)


def dispatch_combine(
    rows: torch.Tensor,
    counts: torch.Tensor,
    compute: LocalCompute,
    *,
    ep: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The experts' output for ``rows`` (this rank's copies sorted by global expert,
    ``counts[e]`` of them for expert ``e``), computed where each expert lives."""
    plan = route(counts, exchange_counts(counts, ep, group))
    arrived = _a2a(rows, plan.recv, plan.send, group)
    done = compute(arrived[plan.order], plan.local_counts)
    back = torch.empty_like(plan.order)
    back[plan.order] = torch.arange(plan.order.numel(), device=plan.order.device)
    return _a2a(done[back], plan.send, plan.recv, group)


@dataclass(frozen=True)
class Sorted:
    """A routed call's copies sorted by expert: which token and weight each row is."""

    token: torch.Tensor
    """The token each sorted row copies."""
    weight: torch.Tensor
    """The router's weight of each sorted row."""
    counts: torch.Tensor
    """Rows per global expert, ``[num_experts]``."""


def sort_routed(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Sorted:
    """Sort a routed call's ``(token, k)`` choices by expert; a choice of
    ``num_experts`` or more (Hugging Face's sentinel for a dropped copy) goes nowhere."""
    k = index.shape[-1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    kept = order[flat[order] < num_experts]
    counts = torch.bincount(flat[kept], minlength=num_experts)
    return Sorted(token=kept // k, weight=weights.reshape(-1)[kept], counts=counts)


def routed_forward(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    compute: LocalCompute,
    *,
    num_experts: int,
    ep: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Hugging Face's experts call: each token's weighted sum over its chosen experts."""
    picked = sort_routed(index, weights, num_experts)
    out = dispatch_combine(x[picked.token], picked.counts, compute, ep=ep, group=group)
    weighted = out * picked.weight.unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, picked.token, weighted.to(x.dtype))
