"""``"ep"``: each layer's experts split over the ``ep`` ranks, tokens sent to them and back.

The order in :meth:`ExpertParallelStrategy.setup_module`: find every layer's
experts (:mod:`.finding`, refusing before any collective), turn their stacked
weights into DTensors sharded on dim 0 over the ``ep`` ranks (each keeps
``num_experts / ep`` experts, sliced from the model as built, so values equal
one process's), give each experts module a forward that dispatches its routed
copies with all-to-alls (:mod:`.dispatch`), place what the rank keeps, then
hook the gradient sync (:mod:`.grads`). Experts kept one module each (an
``nn.ModuleList``) are split by module and their block run under EP instead
(:mod:`.listed`); every :class:`.capacity.Capacity` is pointed at the data ranks.
The experts' own forward computes the local experts on their local weights, so
the model's code (activation, gating, Hugging Face's experts implementations) is
the one that runs.

Expert weights are DTensors so the rest of manygpu sees them as shards: the
gradient norm sums their pieces over ``ep`` (:mod:`manygpu.comm.grad_norm`),
DCP checkpoints store whole tensors that load on another ``ep`` size, and
``full_tensor()`` gives the whole stack.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.utils.stateless import _reparametrize_module

from manygpu.errors import UsageError
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.base import JobOptions
from manygpu.strategies.expert import ExpertParallel
from manygpu.strategies.expert.capacity import Capacity
from manygpu.strategies.expert.dispatch import LocalCompute, dispatch_combine, routed_forward
from manygpu.strategies.expert.finding import ExpertsSite, check_divisible, find_experts
from manygpu.strategies.expert.fsdp import check_fsdp_mesh, shard_with_fsdp
from manygpu.strategies.expert.grads import GradSync
from manygpu.strategies.expert.listed import (
    ignore_elsewhere,
    keep_local,
    listed_forward,
    mark_held,
)
from manygpu.strategies.mesh import MeshShape, job_mesh
from manygpu.strategies.sharded import MeshStrategy
from manygpu.transforms.materialize import Place


class ExpertParallelStrategy(MeshStrategy[ExpertParallel]):
    """Experts sharded over ``ep``; everything else replicated over ``dp`` x ``ep``, or
    with ``fsdp``, everything sharded by FSDP2 as well (:mod:`.fsdp`)."""

    spec_class = ExpertParallel

    needs_process_group = True
    shards_data = True
    compile_refusal = (
        "the experts' all-to-all dispatch is not compiled yet; leave compile off "
        "(or compile the blocks yourself with strategy=Parallelize(fn))"
    )
    channels_last_weights = False  # FSDP2 (with fsdp) refuses non-contiguous weights

    def __init__(self, ctx: DistContext, options: ExpertParallel, job: JobOptions) -> None:
        super().__init__(ctx, options, job)
        self._syncs: weakref.WeakKeyDictionary[nn.Module, GradSync] = weakref.WeakKeyDictionary()

    @classmethod
    def resolve_mesh(cls, world_size: int, job: JobOptions) -> MeshShape:
        """The card's checks, and fsdp with ep but not with dp too (refused at ``Parallel``)."""
        shape = super().resolve_mesh(world_size, job)
        check_fsdp_mesh(shape.sizes())
        return shape

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        sizes = self.shape.sizes()
        ep, dp = sizes["ep"], sizes["dp"]
        sites = find_experts(module, self.options.experts)
        check_divisible(sites, ep)  # the same on every rank: refused before any collective
        listed = [s for s in sites if s.kind == "listed"]
        if listed and sizes["fsdp"] > 1:
            raise UsageError(
                f"strategy 'ep' keeps the experts of {listed[0].path} (an nn.ModuleList) whole "
                "on their ep rank, not sharded over fsdp too; use mesh {'ep': E} or "
                "{'dp': D, 'ep': E}, or stack the experts' weights"
            )
        mesh = job_mesh(self.ctx, self.shape, self.mesh_names)
        ep_mesh = mesh["ep"]
        for capacity in (m for m in module.modules() if isinstance(m, Capacity)):
            capacity.group = dist.group.WORLD  # every rank reads its own data
            capacity.data_rank = self.shape.data_rank(self.ctx.rank)
        for site in sites:
            experts = module.get_submodule(site.path)
            if site.kind == "listed":
                _split_listed(module, site, ep_mesh)
                continue
            _shard_experts(experts, site, ep_mesh)
            experts.forward = _expert_parallel_forward(
                experts, site, ep=ep, group=ep_mesh.get_group()
            )
        if sizes["fsdp"] > 1:  # FSDP2 reduces every gradient: no hand-written sync
            shard_with_fsdp(module, sites, mesh, data_size=self.shape.data_size)
            return place(module, self.ctx.device)
        placed = place(module, self.ctx.device)
        # After place: a meta model's parameters are new tensors now.
        expert_ids = set()
        for site in sites:
            experts = placed.get_submodule(site.path)
            if site.kind == "listed":
                mark_held(experts, ep_mesh.get_group())
                expert_ids |= {id(p) for p in experts.parameters()}
            else:
                expert_ids |= {id(getattr(experts, n)) for n in site.params}
        self._syncs[placed] = GradSync(
            placed,
            expert_ids,
            expert_group=mesh["dp"].get_group() if dp > 1 else None,
            data_size=self.shape.data_size,
            timeout_s=self.ctx.timeout_s,
        )
        return placed

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        sync = self._syncs.get(module)
        if sync is not None:
            sync.enabled = enabled
        else:  # under fsdp: FSDP2's reduce-scatter
            super().set_grad_sync(module, enabled)

    def grad_sync(self, module: nn.Module) -> GradSync | None:
        """The gradient sync of a prepared ``module`` (tests break it on purpose);
        ``None`` under ``fsdp``, where FSDP2 reduces the gradients."""
        return self._syncs.get(module)


def _shard_experts(experts: nn.Module, site: ExpertsSite, ep_mesh: DeviceMesh) -> None:
    """Each stacked weight as a DTensor sharded on dim 0: this rank's experts only.

    Real weights are scattered from the ``ep`` group's first rank, so every rank
    holds the values one process built; a meta model's (``par.init_module()``)
    are cut locally, with no communication, and filled after ``place``."""
    for name in site.params:
        param = getattr(experts, name)
        src = None if param.is_meta else 0
        sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=src)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _split_listed(model: nn.Module, site: ExpertsSite, ep_mesh: DeviceMesh) -> None:
    """A ModuleList of experts: this rank's kept, its block run under EP (:mod:`.listed`)."""
    block = model.get_submodule(site.path.rpartition(".")[0])
    keep_local(model.get_submodule(site.path), site, ep_mesh)  # type: ignore[arg-type]
    ignore_elsewhere(model, site, ep_mesh.size(), ep_mesh.get_local_rank())
    block.forward = listed_forward(
        block, site, ep=ep_mesh.size(), rank=ep_mesh.get_local_rank(), group=ep_mesh.get_group()
    )


@contextmanager
def _local_experts(experts: nn.Module, site: ExpertsSite, count: int) -> Iterator[None]:
    """The module as if it held only this rank's experts: local weights, ``num_experts``."""
    local = {n: getattr(experts, n).to_local() for n in site.params}
    had = "num_experts" in vars(experts)
    before = vars(experts).get("num_experts")
    if had:
        setattr(experts, "num_experts", count)  # noqa: B010 (an int, not a module or tensor)
    try:
        with _reparametrize_module(experts, local):
            yield
    finally:
        if had:
            setattr(experts, "num_experts", before)  # noqa: B010


def _expert_parallel_forward(experts: nn.Module, site: ExpertsSite, *, ep: int, group: Any) -> Any:
    """The experts module's forward under EP, same call signature as its own."""
    own = experts.forward  # the class's (bound), run on the local experts
    count = site.num_experts // ep

    def compute(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        with _local_experts(experts, site, count):
            if site.kind == "grouped":
                return own(rows, torch.tensor(counts, dtype=torch.long, device=rows.device))
            which = torch.arange(count, device=rows.device)
            index = torch.repeat_interleave(which, torch.tensor(counts, device=rows.device))
            ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return own(rows, index.unsqueeze(-1), ones)

    local: LocalCompute = compute
    if site.kind == "grouped":

        def grouped(x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
            counts = num_tokens_per_expert.to(torch.long)
            return dispatch_combine(x, counts, local, ep=ep, group=group)

        return grouped

    def routed(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        return routed_forward(
            x, top_k_index, top_k_weights, local,
            num_experts=site.num_experts, ep=ep, group=group,
        )  # fmt: skip

    return routed
