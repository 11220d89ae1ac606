"""Per-device memory of each strategy: parameters, gradients, optimizer state, activations.

Bytes per parameter follow the ZeRO paper (Rajbhandari et al. 2020, section 3.1):

* fp32 with Adam: 4 (weights) + 4 (gradients) + 8 (Adam's m and v) = 16;
* mixed precision (``bf16``/``fp16`` weights and gradients, fp32 master copy in
  the optimizer): 2 + 2 + (4 + 8) = 16, but only the 4 bytes of weights and
  gradients stay whole under ZeRO-1;
* ZeRO-1 shards the optimizer state over N, ZeRO-2 also the gradients,
  ZeRO-3 / FSDP also the weights (plus one gathered unit at a time);
* pipeline (P stages) and tensor (T ways) parallelism split everything by P or T.

``tf32`` stores everything in fp32 (only the math differs), so it counts as fp32.
Activations are what autograd saves for backward; mixed precision halves them.
Allocator fragmentation and workspace are not modelled (keep ~10% headroom).
"""

from __future__ import annotations

from dataclasses import dataclass

from manygpu.errors import UsageError
from manygpu.plan.desc import ModelDesc
from manygpu.plan.devices import PRECISIONS
from manygpu.strategies.costs import Split
from manygpu.strategies.registry import card

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
"""fp32 state bytes per parameter (Adam: m and v; SGD: the momentum buffer)."""
FP32_STORAGE = ("fp32", "tf32")
"""Precisions whose tensors are fp32 (TF32 changes the multiply, not what is stored)."""


def element_bytes(precision: str) -> int:
    """Bytes of one activation element at ``precision``."""
    return 4 if precision in FP32_STORAGE else 2


@dataclass(frozen=True)
class BytesPerParam:
    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def bytes_per_param(precision: str, optimizer: str) -> BytesPerParam:
    """Weights, gradients and optimizer state (master weights included) per parameter."""
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}; choose {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise UsageError(
            f"unknown optimizer {optimizer!r}; choose {', '.join(OPTIMIZER_STATE_BYTES)}"
        )
    state = OPTIMIZER_STATE_BYTES[optimizer]
    if precision in FP32_STORAGE:
        return BytesPerParam(4, 4, state)
    return BytesPerParam(2, 2, 4 + state)  # fp32 master weights live with the optimizer


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes on one device."""

    strategy: str
    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def fits(self, memory_gb: float, headroom: float = 0.9) -> bool:
        return self.total <= memory_gb * 1e9 * headroom


def estimate(
    desc: ModelDesc,
    strategy: str,
    *,
    world: int,
    batch: int,
    precision: str = "fp32",
    optimizer: str = "adam",
    stages: int = 1,
    microbatches: int = 1,
) -> MemoryEstimate:
    """Bytes per device of ``strategy`` on ``world`` devices.

    ``batch`` is per device (a pipeline / tensor replica trains ``stages x batch``);
    ``stages``: pipeline / tensor / model ways; ``microbatches``: the pipeline's.
    """
    model = card(strategy).memory  # raises for unknown names, listing the known ones
    if world < 1 or stages < 1 or batch < 1:
        raise UsageError("world size, stages and batch must be >= 1")
    b = bytes_per_param(precision, optimizer)
    p = float(desc.parameters)
    act = desc.activation_bytes_per_sample * batch * element_bytes(precision) / 4
    divisor = {"whole": 1, "world": world, "ways": stages}

    def split(nbytes: float, how: Split) -> float:
        return nbytes / divisor[how]

    w = split(p * b.weights, model.weights)
    g = split(p * b.grads, model.grads)
    o = split(p * b.optimizer, model.optimizer)
    if model.gathered_unit:  # this unit + the prefetched one, whole
        w += 2 * desc.largest_layer_parameters * b.weights
    if model.activations == "ways":  # one process's batch, its layers spread over the devices
        act /= stages
    elif model.activations == "in_flight":
        # 1F1B keeps at most `stages` micro-batches in flight, each of 1/stages of the layers.
        act *= min(stages, microbatches) / max(microbatches, 1)
    return MemoryEstimate(strategy=strategy, params=w, grads=g, optimizer=o, activations=act)
