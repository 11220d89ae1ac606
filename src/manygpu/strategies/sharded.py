"""The shared base of strategies that compose over a mesh and replace parameters.

FSDP2 turns parameters into sharded DTensors, tensor parallelism into DTensor
slices, a pipeline keeps only its stage's. Each composes over named axes of
the job's mesh (:mod:`.mesh`; which ones, its card says) and turns FSDP2's
gradient sync on and off for accumulation; an optimizer built before
``prepare`` is rebound to the new parameters by the core
(:mod:`manygpu.core.rebind`), not here. ``fsdp``,
``zero2``, ``tensor``, ``pipeline`` and ``parallelize`` derive from it; the
FSDP2 calls that compose them are in :mod:`.fsdp.sharding`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from manygpu.errors import UsageError
from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.abilities import PlacesRanks
from manygpu.strategies.axes import axis, replica_axis
from manygpu.strategies.base import JobOptions, OptionsT, Strategy, given_repr
from manygpu.strategies.mesh import MeshShape, check_axes, composed_axes, job_mesh


class MeshStrategy(Strategy[OptionsT]):
    """A strategy that composes over named mesh axes and replaces parameters.

    Which axes, and which one takes the world when no mesh is given, are on its
    card (``mesh_axes``, ``mesh_default``), not in code.
    """

    # FSDP2 refuses non-contiguous parameters ("FSDP does not support
    # non-contiguous parameters yet"): weights stay as they are, inputs go channels_last.
    channels_last_weights = False

    def __init__(self, ctx: DistContext, options: OptionsT, job: JobOptions) -> None:
        super().__init__(ctx, options, job)
        self.shape = self.resolve_mesh(ctx.world_size, job)
        """The job's mesh shape, ``-1`` resolved."""
        self.mesh_names = composed_axes(self.shape, self.card.axes(), self.card.mesh_default)
        """The axes of the job's mesh this strategy composes, outermost first."""
        self.data_names = tuple(n for n in self.mesh_names if axis(n).splits_data)
        """The composed axes that split data, outermost first: the ones FSDP2 shards
        over (none, ``fsdp``, or ``dp, fsdp`` for HSDP)."""

    def __repr__(self) -> str:
        """The options and the mesh this strategy composes: ``..., mesh=dp:2,fsdp:4``."""
        sizes = self.shape.sizes()
        mesh = ",".join(f"{n}:{sizes[n]}" for n in self.mesh_names)
        return f"{type(self).__name__}({given_repr(self.options)}, mesh={mesh})"

    @classmethod
    def resolve_mesh(cls, world_size: int, job: JobOptions) -> MeshShape:
        """The user's mesh (or the card's default axis over every rank), ``-1`` filled in,
        checked against the axes the card names."""
        shape = job.mesh if job.mesh is not None else MeshShape(**{cls.card.mesh_default: -1})
        check_axes(cls.name, shape, cls.card.axes())
        return shape.resolve(world_size)

    @classmethod
    def validate_world(cls, cluster: ClusterInfo, options: OptionsT, job: JobOptions) -> None:
        cls.resolve_mesh(cluster.world_size, job)

    def data_shard(self) -> tuple[int, int]:
        return self.shape.data_rank(self.ctx.rank), self.shape.data_size

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        # Here, not at the top: FSDP2 loads DTensor and sympy (~1 CPU-s), which a
        # process that only builds a Parallel, or runs DDP, does not need.
        from manygpu.strategies.fsdp.sharding import set_fsdp_grad_sync

        set_fsdp_grad_sync(module, enabled)


def device_mesh(strategy: Strategy[Any]) -> DeviceMesh:
    """The job's mesh as ``strategy`` composes it; a 1-D mesh on the replica axis
    (``dp``) over the ranks for one that replicates (ddp, zero1, model over dp)."""
    if isinstance(strategy, MeshStrategy):
        return job_mesh(strategy.ctx, strategy.shape, strategy.mesh_names)
    if isinstance(strategy, PlacesRanks):
        raise UsageError(
            f"strategy {strategy.name!r} places its ranks in roles: it has no device mesh"
        )
    if not dist.is_initialized():
        raise UsageError(
            f"strategy {strategy.name!r} runs in one process without a process group: "
            "it has no device mesh"
        )
    ctx = strategy.ctx
    replicas = replica_axis()
    return job_mesh(ctx, MeshShape(**{replicas: ctx.world_size}), (replicas,))
