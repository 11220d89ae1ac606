"""FP8 under FSDP2: weights all-gathered in float8, their scales computed once per step.

torchao wraps each converted weight (``enable_fsdp_float8_all_gather``) so
FSDP2 casts the local shard to float8 *before* the all-gather: half the bytes
of a bf16 gather. Casting needs the whole weight's amax; by default each
layer's pre-all-gather all-reduces its own. ``precompute_float8_dynamic_scale_for_fsdp``
(still torchao 0.18's advice) does every layer's in one all-reduce after the
optimizer step, and the layers then use that scale until the next call.

That scale is kept on the weight, so it must never outlive the weights it was
computed from: after a checkpoint loads other weights, the scales are cleared
and each layer computes its own again until the next optimizer step.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn
from torch.distributed.tensor import DTensor

from manygpu.transforms.fp8 import TrainsFp8


def _cast_weights(module: nn.Module) -> list[object]:
    """The local tensors of ``module``'s weights that FSDP2 gathers in float8."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    found: list[object] = []
    for param in module.parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, WeightWithDynamicFloat8CastTensor):
            found.append(local)
    return found


class Fsdp2Fp8(TrainsFp8):
    """The fp8 ability of the FSDP2 strategies (``fsdp``, ``zero2``)."""

    fp8_all_gather: ClassVar[bool] = True

    def fp8_after_step(self, module: nn.Module) -> None:
        """One all-reduce for every float8 weight's scale (a collective: every rank
        steps its optimizer together, so every rank arrives here)."""
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(module)

    def fp8_after_load(self, module: nn.Module) -> None:
        """Forget the scales of the weights a checkpoint replaced (local: no collective)."""
        for local in _cast_weights(module):
            local._precomputed_scale = None  # type: ignore[attr-defined]
