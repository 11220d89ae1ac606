"""The router's load-balancing loss over the global batch, as one process computes it.

Switch Transformer's auxiliary loss (Hugging Face's ``load_balancing_loss_func``)
is ``num_experts * sum_e f_e * P_e``: ``f_e`` the fraction of routed copies
that chose expert ``e``, ``P_e`` its mean router probability. Both are means
over the batch, and their product is not linear in it: the mean of each data
rank's own loss is not the loss of the global batch. Here the sums behind
``f`` and ``P`` are summed over the data ranks first. ``P``'s sum goes through
an all-reduce that autograd sees (its backward sums the ranks' gradients), so
each rank's backward carries ``R`` times its tokens' share and the gradient
sync's division by ``R`` (:mod:`.grads`) leaves exactly one process's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def _summed(t: torch.Tensor, group: Any, *, grad: bool) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized()):
        return t
    if grad:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t, group=group or dist.group.WORLD)
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int, *, group: Any = None
) -> torch.Tensor:
    """``num_experts * sum_e f_e * P_e`` over every data rank's tokens (no padding mask).

    ``router_logits``: one ``[tokens, num_experts]`` tensor per layer (Hugging Face's
    ``outputs.router_logits`` with ``output_router_logits=True``). Every data rank
    calls it in the same step; in one process it equals ``load_balancing_loss_func``.
    """
    chosen = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(chosen)
    rows = torch.zeros((), dtype=torch.float32, device=chosen.device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        picked = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        chosen = chosen + torch.bincount(picked, minlength=num_experts).float()
        probs = probs + p.sum(0)
        rows = rows + p.shape[0]
    chosen = _summed(chosen, group, grad=False)
    rows = _summed(rows, group, grad=False)
    probs = _summed(probs, group, grad=True)
    return num_experts * torch.sum((chosen / rows) * (probs / rows))
