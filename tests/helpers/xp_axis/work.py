"""The class doing the work of ``toy-xp``: everything mesh-shaped comes from its card."""

from __future__ import annotations

from torch import nn

from manygpu.strategies.mesh import job_mesh
from manygpu.strategies.sharded import MeshStrategy
from manygpu.transforms.materialize import Place
from xp_axis import ExpertSplit


class ExpertSplitStrategy(MeshStrategy[ExpertSplit]):
    """Builds the job's mesh over the composed axes; the model stays whole."""

    spec_class = ExpertSplit
    needs_process_group = True
    shards_data = True

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        job_mesh(self.ctx, self.shape, self.mesh_names)
        return place(module, self.ctx.device)
