"""The shared base of strategies that compose over a mesh and replace parameters.

FSDP2 turns parameters into sharded DTensors, tensor parallelism into DTensor
slices, a pipeline keeps only its stage's. Each composes over named dimensions
of the job's mesh (:mod:`.mesh`) and turns FSDP2's gradient sync on and off for
accumulation; an optimizer built before ``prepare`` is rebound to the new
parameters by the core (:mod:`manygpu.core.rebind`), not here. ``fsdp``,
``zero2``, ``tensor``, ``pipeline`` and ``parallelize`` derive from it; the
FSDP2 calls that compose them are in :mod:`.fsdp.sharding`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from manygpu.errors import UsageError
from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.abilities import PlacesRanks
from manygpu.strategies.base import JobOptions, OptionsT, Strategy, given_repr
from manygpu.strategies.fsdp.sharding import set_fsdp_grad_sync
from manygpu.strategies.mesh import MeshSpec, check_dims, composed_dims, job_mesh


class MeshStrategy(Strategy[OptionsT]):
    """A strategy that composes over named mesh dimensions and replaces parameters."""

    mesh_dims: ClassVar[tuple[str, ...]] = ("dp", "fsdp")
    """The dimensions it can use; others must be 1."""
    default_mesh: ClassVar[dict[str, int]] = {"fsdp": -1}
    """The mesh used when the user gives none."""
    # FSDP2 refuses non-contiguous parameters ("FSDP does not support
    # non-contiguous parameters yet"): weights stay as they are, inputs go channels_last.
    channels_last_weights = False

    def __init__(self, ctx: DistContext, options: OptionsT, job: JobOptions) -> None:
        super().__init__(ctx, options, job)
        self.spec = self.resolve_mesh(ctx.world_size, job)
        self.mesh_names = composed_dims(self.spec, tuple(self.default_mesh))
        """The dimensions of the job's mesh this strategy composes, outermost first."""

    def __repr__(self) -> str:
        """The options and the mesh this strategy composes: ``..., mesh=dp:2,fsdp:4``."""
        sizes = self.spec.sizes()
        mesh = ",".join(f"{n}:{sizes[n]}" for n in self.mesh_names)
        return f"{type(self).__name__}({given_repr(self.options)}, mesh={mesh})"

    @classmethod
    def resolve_mesh(cls, world_size: int, job: JobOptions) -> MeshSpec:
        """The user's mesh (or the default) with ``-1`` filled in, checked."""
        spec = job.mesh if job.mesh is not None else MeshSpec(**cls.default_mesh)
        check_dims(cls.name, spec, cls.mesh_dims)
        return spec.resolve(world_size)

    @classmethod
    def validate_world(cls, cluster: ClusterInfo, options: OptionsT, job: JobOptions) -> None:
        cls.resolve_mesh(cluster.world_size, job)

    def data_shard(self) -> tuple[int, int]:
        return self.spec.data_rank(self.ctx.rank), self.spec.data_size

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        set_fsdp_grad_sync(module, enabled)


def device_mesh(strategy: Strategy[Any]) -> DeviceMesh:
    """The job's mesh as ``strategy`` composes it; a 1-D ``dp`` mesh over the ranks for
    one that replicates (ddp, zero1, model over dp)."""
    if isinstance(strategy, MeshStrategy):
        return job_mesh(strategy.ctx, strategy.spec, strategy.mesh_names)
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
    return job_mesh(ctx, MeshSpec(dp=ctx.world_size), ("dp",))
