"""Gradients under expert parallelism: what each parameter's gradient must be, and its sync.

One process on the global batch minimises ``L = (1/R) * sum_r L_r``, where
``L_r`` is the mean loss of data shard ``r`` and ``R`` the number of shards
(``dp * ep``: every rank reads its own). After each rank's backward:

- a replicated parameter (router, attention, norms) holds ``dL_r/dtheta`` of
  its own shard: the sum over all ``R`` ranks divided by ``R`` is ``dL/dtheta``
  (DDP's average);
- an expert's slice lives on one rank of each ``ep`` group, and the backward
  of the dispatch all-to-all delivers there the gradient of *every* rank's
  loss of that group: it holds ``sum_{r in its ep group} dL_r/dtheta``. Summed
  over the ``dp`` replicas of that slice it is ``sum_r dL_r/dtheta``, so it too
  is divided by ``R``, not by the size of the group it is reduced over. An
  average over ``dp`` alone leaves it ``ep`` times too big (pytorch#160285).

A parameter that got no gradient on any rank keeps none (an optimizer then
skips it, as one process would); one that got one somewhere gets zeros where
it did not, so every rank reduces the same tensors. For experts, "any rank"
means any rank holding the same experts (the ``dp`` replicas): experts kept one
module per expert are different tensors on each ``ep`` rank. The sync runs once per
backward, when autograd has finished (queued from the first gradient's
hook), so ``loss.backward()`` works as well as ``par.backward(loss)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from manygpu.comm.common import describe, wait


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class GradSync:
    """Averages a model's gradients the way one process on the global batch has them."""

    def __init__(
        self,
        module: nn.Module,
        experts: set[int],
        *,
        expert_group: Any,
        data_size: int,
        timeout_s: float,
    ) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.experts = experts
        """``id()`` of the expert parameters (reduced over ``expert_group`` only)."""
        self.expert_group = expert_group
        """The ranks holding the same experts (``dp``), or ``None`` when there is one."""
        self.data_size = data_size
        self.timeout_s = timeout_s
        self.enabled = True
        """Off for accumulation's micro-steps: the summed gradients are synced once."""
        self.scale_experts = 1.0
        """A factor on the expert gradients after the sync (tests show ``ep`` breaks it)."""
        self._queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _: torch.Tensor) -> None:
        if self.enabled and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Reduce every gradient as the module docstring derives (all ranks call it)."""
        plain = self._present(False, None)
        # Asked of the ranks holding the same experts only: another ep rank's experts
        # (one module each) are other tensors, and one nobody here used keeps none.
        experts = self._present(True, self.expert_group)
        self._average(plain, "replicated gradients", over_world=True)
        self._average(experts, "expert gradients", over_world=False)

    def _present(self, experts: bool, group: Any) -> list[nn.Parameter]:
        """The expert (or other) parameters with a gradient on some rank of ``group``
        (the world for ``None``)."""
        mine = [p for p in self.params if (id(p) in self.experts) == experts]
        had = torch.tensor([float(p.grad is not None) for p in mine])
        if group is not None or not experts:
            self._reduce([had], group, "which parameters have gradients")
        return [p for p, n in zip(mine, had.tolist(), strict=True) if n > 0]

    def _average(self, params: Sequence[nn.Parameter], what: str, *, over_world: bool) -> None:
        """Sum over the world (replicated) or over the expert replicas, then divide by R."""
        group = None if over_world else self.expert_group
        factor = 1.0 if over_world else self.scale_experts
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for same in by_dtype.values():
            grads = [
                _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in same
            ]
            flat = _flatten_dense_tensors(grads)
            if over_world or group is not None:
                self._reduce([flat], group, what)
            flat.mul_(factor / self.data_size)
            for p, synced in zip(same, _unflatten_dense_tensors(flat, grads), strict=True):
                _set_grad(p, synced)

    def _reduce(self, tensors: list[torch.Tensor], group: Any, what: str) -> None:
        for t in tensors:
            work = dist.all_reduce(t, group=group, async_op=True)
            wait(work, describe(f"expert parallelism's all-reduce of {what}", t), self.timeout_s)


def _set_grad(p: nn.Parameter, synced: torch.Tensor) -> None:
    if p.grad is not None:
        _local(p.grad).copy_(synced)
        return
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        p.grad = synced.clone()
        return
    from torch.distributed.tensor import DTensor

    p.grad = DTensor.from_local(synced.clone(), mesh, p.placements)  # type: ignore[attr-defined]
