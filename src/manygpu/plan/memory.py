"""Per-device memory of each strategy: what manygpu allocates, not an idealised recipe.

manygpu's mixed precision is autocast over fp32 weights (:mod:`manygpu.core.precision`),
so under every precision a parameter costs what it costs in fp32:

* 4 bytes of weights + 4 of gradients + the optimizer's fp32 state (Adam's m
  and v: 8) = 16 with Adam: there is no separate master copy, and no 2-byte
  weights or gradients as in the ZeRO paper's mixed-precision accounting;
* under ``bf16``/``fp16`` autocast casts each weight a layer computes with to
  16 bits and autograd keeps that copy for the backward: 2 more bytes per
  parameter from forward to backward, even under FSDP2 (the copies outlive the
  resharded fp32 units) -- an upper bound (a first layer whose input needs no
  gradient keeps none);
* FSDP2 with ``param_dtype`` (``FSDP(param_dtype="bf16")``, the card's
  ``compute_dtype_option``) gathers 16-bit units instead: the sharded fp32
  weights, gradients and optimizer state stay, the gathered copies take 2
  bytes, and autocast has nothing to cast.

Where each piece lives is data on the strategy's card
(:class:`~manygpu.strategies.costs.MemoryModel`): whole, split over the
data-parallel ranks (ZeRO / FSDP) or over the model-split ways (pipeline
stages, tensor shards; a mixture of experts' experts over expert
parallelism's ``ep``, the rest whole); plus the unsharded units FSDP2 gathers (one and the
prefetched next, or all of them for ZeRO-2 from forward to backward).
``tf32`` stores everything in fp32 (only the math differs), so it counts as fp32.
Activations are what autograd saves for backward; 16-bit halves them.
Allocator fragmentation and workspace are not modelled (keep ~10% headroom).

``prepare`` is the other peak: while ``prepare`` places the model and fills it
(an init, or ``weights=`` read into the shards), a device holds what it keeps
of the weights plus one module whole in flight (an init's twin, or one tensor
read from a file), before any gradient or optimizer state exists. That is
for a model built under ``par.init_module()``; one built with values is first
whole in every process's host memory (:func:`init_module_note`).
"""

from __future__ import annotations

from dataclasses import dataclass

from manygpu.errors import UsageError
from manygpu.plan import recompute
from manygpu.plan.desc import ModelDesc
from manygpu.plan.devices import PRECISIONS
from manygpu.strategies.costs import MemoryModel, Split
from manygpu.strategies.registry import card

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
"""fp32 state bytes per parameter (Adam: m and v; SGD: the momentum buffer)."""
FP32_STORAGE = ("fp32", "tf32")
"""Precisions whose tensors are fp32 (TF32 changes the multiply, not what is stored)."""
FP32_BYTES = 4
"""Bytes of a parameter or gradient as manygpu holds it, under every precision."""


def element_bytes(precision: str) -> int:
    """Bytes of one activation (or computed-with weight) element at ``precision``."""
    return 4 if precision in FP32_STORAGE else 2


@dataclass(frozen=True)
class BytesPerParam:
    """What one parameter costs between steps, and the width layers compute it in."""

    weights: float
    grads: float
    optimizer: float
    compute: float
    """Bytes of the weight as a layer uses it: 4 in fp32, 2 under 16-bit autocast."""

    @property
    def total(self) -> float:
        """Held between steps: weights, gradients and optimizer state."""
        return self.weights + self.grads + self.optimizer


def bytes_per_param(precision: str, optimizer: str) -> BytesPerParam:
    """Weights, gradients and optimizer state per parameter, as manygpu holds them."""
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}; choose {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise UsageError(
            f"unknown optimizer {optimizer!r}; choose {', '.join(OPTIMIZER_STATE_BYTES)}"
        )
    state = OPTIMIZER_STATE_BYTES[optimizer]
    return BytesPerParam(FP32_BYTES, FP32_BYTES, state, element_bytes(precision))


def params_in_compute_dtype(strategy: str, precision: str) -> bool:
    """Whether the planner runs ``strategy`` with its parameters gathered in 16 bits
    (its card names a ``compute_dtype_option`` and the precision is 16-bit)."""
    return bool(card(strategy).memory.compute_dtype_option) and element_bytes(precision) == 2


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes on one device."""

    strategy: str
    params: float
    """fp32 parameters held between steps (this device's shard or split)."""
    grads: float
    optimizer: float
    activations: float
    gathered: float = 0.0
    """Whole copies of weights alive during a step: FSDP2's unsharded units and
    autocast's 16-bit copies kept for the backward."""
    prepare: float = 0.0
    """The peak while ``prepare`` places and fills the model (module docstring)."""

    @property
    def held(self) -> float:
        """Parameters, gradients and optimizer state: what stays between steps."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.held + self.gathered + self.activations

    @property
    def peak(self) -> float:
        """The larger of a training step's total and ``prepare``'s peak."""
        return max(self.total, self.prepare)

    def fits(self, memory_gb: float, headroom: float = 0.9) -> bool:
        return self.peak <= memory_gb * 1e9 * headroom


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
    checkpointing: str | int | None = None,
) -> MemoryEstimate:
    """Bytes per device of ``strategy`` on ``world`` devices, as the planner runs it
    (16-bit gathers where :func:`params_in_compute_dtype`).

    ``batch`` is per device (a pipeline / tensor replica trains ``stages x batch``);
    ``stages``: pipeline / tensor / model ways; ``microbatches``: the pipeline's;
    ``checkpointing``: activation checkpointing's mode (see :mod:`.recompute`).
    """
    desc = recompute.applied(desc, checkpointing)
    model = card(strategy).memory  # raises for unknown names, listing the known ones
    if world < 1 or stages < 1 or batch < 1:
        raise UsageError("world size, stages and batch must be >= 1")
    b = bytes_per_param(precision, optimizer)
    p = float(desc.parameters)
    divisor = {"whole": 1, "world": world, "ways": stages}

    def split(nbytes: float, how: Split) -> float:
        return nbytes / divisor[how]

    def held(per_param: float, how: Split) -> float:
        """Bytes of one kind of state; expert parameters apart where the card says so."""
        if model.experts is None:
            return split(p * per_param, how)
        experts = float(desc.expert_parameters)
        return split((p - experts) * per_param, how) + split(experts * per_param, model.experts)

    params = held(b.weights, model.weights)
    return MemoryEstimate(
        strategy=strategy,
        params=params,
        prepare=params + desc.largest_layer_parameters * FP32_BYTES,
        grads=held(b.grads, model.grads),
        optimizer=held(b.optimizer, model.optimizer),
        gathered=_gathered(desc, model, b, params_in_compute_dtype(strategy, precision), stages),
        activations=_activations(desc, model, batch, precision, stages, microbatches),
    )


def _gathered(
    desc: ModelDesc, model: MemoryModel, b: BytesPerParam, low: bool, stages: int
) -> float:
    """FSDP2's unsharded units (16-bit with ``low``) plus autocast's weight copies."""
    p = float(desc.parameters)
    width = b.compute if low else b.weights
    units = {"none": 0.0, "unit": 2.0 * desc.largest_layer_parameters, "whole": p}
    out = units[model.gathered] * width
    if b.compute < b.weights and not low:  # autocast's 16-bit copies, kept for the backward
        kept = p / stages if model.weights == "ways" else p
        if model.experts == "ways":  # only this device's experts compute here
            kept -= desc.expert_parameters * (1 - 1 / stages)
        out += kept * b.compute
    return out


def _activations(
    desc: ModelDesc,
    model: MemoryModel,
    batch: int,
    precision: str,
    stages: int,
    microbatches: int,
) -> float:
    scale = batch * element_bytes(precision) / 4
    act = desc.activation_bytes_per_sample * scale
    if model.activations == "ways":  # one process's batch, its layers spread over the devices
        act /= stages
    elif model.activations == "in_flight":
        # 1F1B keeps at most `stages` micro-batches in flight, each of 1/stages of the layers.
        act *= min(stages, microbatches) / max(microbatches, 1)
    elif model.activations == "tp_sharded":  # attention's and the MLP's split over the ways
        act -= desc.tp_sharded_activation_bytes_per_sample * scale * (1 - 1 / stages)
    return act


def init_module_note(desc: ModelDesc, memory_gb: float, processes_per_node: int) -> str | None:
    """Why this model must be built under ``par.init_module()``, or ``None``.

    Built with values, every process first holds the whole model in fp32 in
    host memory (and a replicating strategy on its device): past one device's
    memory that cannot be what the job wants.
    """
    whole = float(desc.parameters) * FP32_BYTES
    if whole <= memory_gb * 1e9 * 0.9:
        return None
    host = whole * processes_per_node
    return (
        f"build the model under par.init_module() (and give prepare(..., weights=PATH) "
        f"for pretrained values): its fp32 weights ({whole / 1e9:,.1f} GB) exceed one "
        f"device's {memory_gb:,.1f} GB, and built whole, {processes_per_node} process(es) "
        f"per node would first hold {host / 1e9:,.1f} GB of host memory"
    )
