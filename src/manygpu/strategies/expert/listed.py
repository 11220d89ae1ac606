"""Experts kept one module per expert (``nn.ModuleList``), split over the ``ep`` ranks.

transformers 4.x Mixtral (``block_sparse_moe``), Qwen2-MoE and Qwen3-MoE, and
many hand-written models, hold ``experts = nn.ModuleList([MLP, ...])`` beside
a router ``gate`` in a sparse block whose forward loops over the experts it
routed to. Under EP each rank keeps the ``num_experts / ep`` expert modules of
its run of experts (rank ``r``: ``[r*L, (r+1)*L)``, as for stacked experts);
the others are replaced by parameterless :class:`Elsewhere` markers, so the
rank's parameter names are one process's (``experts.2.w1.weight``): a DCP
checkpoint stores each expert under its own name from the rank that holds it,
and any ``ep`` size, or a job without EP, reads back the ones it keeps; a
weights file (``weights=``) gives each rank its experts' tensors and the others
are passed over. On a model built empty (``par.init_module()``) the dropped
experts are never allocated.

The block's loop cannot run under EP (a rank does not hold the experts it
would call, and ranks would call different experts), so its forward is
replaced by the one of those Hugging Face 4.x blocks: softmax over the
router's logits (fp32), top-``k``, renormalised unless the block's
``norm_topk_prob`` is false, each routed copy sent to its expert's rank and
back (:func:`.dispatch.routed_forward`), plus a ``shared_expert`` (times
``sigmoid(shared_expert_gate(x))``) where the block has one; it returns
``(hidden_states, router_logits)`` as they do. An expert that receives no row
is not called, as the loop does not call it: its gradient stays ``None`` when
no rank of the job routed to it, so the optimizer skips it as one process does.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from manygpu.comm.grad_norm import HELD_OVER
from manygpu.errors import UsageError
from manygpu.strategies.expert.dispatch import routed_forward
from manygpu.strategies.expert.finding import ExpertsSite


class Elsewhere(nn.Module):
    """Stands for an expert another ``ep`` rank holds: no parameters, never called."""

    def __init__(self, index: int, owner: int) -> None:
        super().__init__()
        self.index, self.owner = index, owner

    def extra_repr(self) -> str:
        return f"expert {self.index} on ep rank {self.owner}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(
            f"expert {self.index} lives on ep rank {self.owner}: call the sparse block, "
            "not one of its experts, under strategy 'ep'"
        )


def local_range(site: ExpertsSite, ep: int, rank: int) -> range:
    """The experts ep rank ``rank`` keeps."""
    count = site.num_experts // ep
    return range(rank * count, (rank + 1) * count)


@torch.no_grad()
def keep_local(experts: nn.ModuleList, site: ExpertsSite, ep_mesh: DeviceMesh) -> None:
    """Drop the other ranks' experts; the kept ones take the values of the ``ep``
    group's first rank (scattered from it, as stacked experts are), real or not."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    mine = local_range(site, ep, rank)
    if not any(p.is_meta for p in experts.parameters()):
        for name in site.params:
            whole = torch.stack([e.get_parameter(name).detach() for e in experts])
            part = distribute_tensor(whole, ep_mesh, [Shard(0)], src_data_rank=0).to_local()
            for offset, index in enumerate(mine):
                experts[index].get_parameter(name).copy_(part[offset])
    count = len(mine)
    for index in range(site.num_experts):
        if index not in mine:
            experts[index] = Elsewhere(index, index // count)


IGNORED = "_keys_to_ignore_on_load_unexpected"
"""Hugging Face's list of regexes for a file's keys a model may lack (manygpu's
``weights=`` honours it): here, the experts other ``ep`` ranks hold."""


def ignore_elsewhere(root: nn.Module, site: ExpertsSite, ep: int, rank: int) -> None:
    """A weights file's other experts are not this rank's to load: not "unexpected"."""
    mine = local_range(site, ep, rank)
    others = [
        r"(^|\.)" + re.escape(f"{site.path}.{index}.")
        for index in range(site.num_experts)
        if index not in mine
    ]
    setattr(root, IGNORED, list(getattr(root, IGNORED, None) or []) + others)


def mark_held(experts: nn.Module, group: Any) -> None:
    """Tell the gradient norm that each ``ep`` rank holds other experts' tensors."""
    for param in experts.parameters():
        setattr(param, HELD_OVER, group)


def listed_forward(block: nn.Module, site: ExpertsSite, *, ep: int, rank: int, group: Any) -> Any:
    """The sparse block's forward under EP (see the module docstring)."""
    experts = block.get_submodule(site.path.rpartition(".")[2])
    assert isinstance(experts, nn.ModuleList)  # found as one (finding.listed_site)
    mine = local_range(site, ep, rank)

    def compute(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for index, chunk in zip(mine, torch.split(rows, counts), strict=True):
            # An empty chunk stands for the expert's output: zero rows, still on the graph
            # (the combine all-to-all's backward must run on every rank).
            outs.append(experts[index](chunk) if chunk.shape[0] else chunk)
        return torch.cat(outs)

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = block.get_submodule("gate")(x)
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        weights, index = torch.topk(probs, site.top_k, dim=-1)
        if getattr(block, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = routed_forward(
            x, index, weights.to(x.dtype), compute,
            num_experts=site.num_experts, ep=ep, group=group,
        )  # fmt: skip
        shared = getattr(block, "shared_expert", None)
        if shared is not None:
            extra = shared(x)
            shared_gate = getattr(block, "shared_expert_gate", None)
            if shared_gate is not None:
                extra = torch.sigmoid(shared_gate(x)) * extra
            out = out + extra
        return out.reshape(hidden_states.shape), logits

    return forward
