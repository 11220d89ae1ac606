"""The user's plan over the job's mesh (see :mod:`manygpu.strategies.parallelize`)."""

from __future__ import annotations

from torch import nn

from manygpu.errors import UsageError
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.base import JobOptions
from manygpu.strategies.mesh import job_mesh
from manygpu.strategies.parallelize import Parallelize
from manygpu.strategies.sharded import MeshStrategy
from manygpu.transforms.materialize import Place


class ParallelizeStrategy(MeshStrategy[Parallelize]):
    """``fn(model, mesh)`` on this rank's device; the parameters it leaves are the model's."""

    spec_class = Parallelize
    needs_process_group = True
    shards_data = True

    def __init__(self, ctx: DistContext, options: Parallelize, job: JobOptions) -> None:
        super().__init__(ctx, options, job)
        # Every axis the user sized, in the mesh's order (the card's default when none
        # is): the user's plan gets the mesh they asked for, not FSDP2's reading of it.
        self.mesh_names = self.shape.sized() or (self.card.mesh_default,)

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        mesh = job_mesh(self.ctx, self.shape, self.mesh_names)
        returned = self.options.fn(module, mesh)
        if returned is not None and not isinstance(returned, nn.Module):
            raise UsageError(
                f"Parallelize's fn returned a {type(returned).__name__}: return the model "
                "(or None when it parallelizes the model in place)"
            )
        prepared = returned if returned is not None else module
        # The plan applied to the model as built (meta under init_module()), then
        # what this rank keeps allocated on its device.
        return place(prepared, self.ctx.device)
