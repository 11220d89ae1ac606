"""``{"fsdp": F, "ep": E}``: FSDP2 over the data axes, experts sharded over what remains.

Every rank reads its own data (``R = F * E`` shards). Then:

- the experts' stacked weights, already DTensors split on dim 0 over ``ep``,
  are sharded again by FSDP2 over ``fsdp`` (its ``fully_shard`` on each experts
  module, on the ``fsdp`` sub-mesh of the same mesh: a 2-D ``(fsdp, ep)``
  DTensor whose dim 0 is split both ways). Their gradient, after the dispatch
  all-to-all's backward, already sums the losses of the whole ``ep`` group;
  FSDP2's reduce-scatter sums it over ``fsdp`` too, so it is divided by ``R``
  (``set_gradient_divide_factor``), not by ``F``: FSDP2's default would leave
  it ``E`` times too big (pytorch#160285).
- every other parameter is sharded by FSDP2 over all ``R`` ranks (the ``fsdp``
  and ``ep`` axes flattened: torchtitan's ``dp_shard`` including ``ep``), block
  by block, then the root; its reduce-scatter averages over ``R``.

So FSDP2 does every gradient reduction here; the hand-written sync of
:mod:`.grads` is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from manygpu.errors import UsageError
from manygpu.strategies.expert.finding import ExpertsSite
from manygpu.strategies.fsdp import FSDP
from manygpu.strategies.fsdp.sharding import fsdp_kwargs, shard_data_dims

FLAT = "fsdp_ep"
"""The name of the flattened ``(fsdp, ep)`` axis the non-expert parameters shard over."""


def check_fsdp_mesh(sizes: dict[str, int]) -> None:
    """FSDP2 with experts composes ``fsdp`` and ``ep`` only (no ``dp`` replicas yet)."""
    if sizes["fsdp"] > 1 and sizes["dp"] > 1:
        raise UsageError(
            f"strategy 'ep' composes fsdp with ep, or dp with ep, not all three (dp={sizes['dp']}, "
            f"fsdp={sizes['fsdp']}); drop dp from the mesh or use fsdp=1"
        )


def shard_with_fsdp(
    module: nn.Module, sites: Sequence[ExpertsSite], mesh: DeviceMesh, *, data_size: int
) -> None:
    """FSDP2 over ``module`` as the module docstring says (expert weights already split)."""
    import torch

    kwargs = fsdp_kwargs(FSDP(), torch.device(mesh.device_type), reshard_after_forward=True)
    for site in sites:
        experts = module.get_submodule(site.path)
        fully_shard(experts, mesh=mesh["fsdp"], **kwargs)
        assert isinstance(experts, FSDPModule)
        experts.set_gradient_divide_factor(float(data_size))
        # A custom factor is a pre-multiplied sum, which gloo lacks: sum, then divide.
        experts.set_force_sum_reduction_for_comms(True)
    flat = mesh._flatten(FLAT) if FLAT not in (mesh.mesh_dim_names or ()) else mesh[FLAT]
    shard_data_dims(module, flat, kwargs, children=True)
