"""What the planner needs to know about a model: counts, not code.

A :class:`ModelDesc` comes from numbers (a parameter count and shape, e.g. a
7B transformer) or from a real ``nn.Module``, measured: parameters counted,
FLOPs per sample from ``FlopCounterMode`` (and how many of them are
convolutions: conv nets and transformers reach different fractions of a
GPU's peak, see :mod:`.devices`), activation bytes per sample from the
tensors autograd saves for backward (what a step actually keeps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from manygpu.errors import UsageError
from manygpu.plan.recompute import measure_blocks


@dataclass(frozen=True, kw_only=True)
class ModelDesc:
    """A model for planning. Give ``step_compute_s`` when measured, else FLOPs."""

    name: str
    parameters: int
    flops_per_sample: float = 0.0
    """Forward + backward FLOPs per sample (0: unknown)."""
    conv_flops_per_sample: float = 0.0
    """The part of ``flops_per_sample`` in convolutions (timed at the device's conv rate)."""
    step_compute_s: float | None = None
    """Measured forward + backward + optimizer seconds of one step on one device
    at ``compute_batch`` samples; beats a FLOP estimate when known."""
    compute_batch: int = 0
    """The batch ``step_compute_s`` was measured at."""
    activation_bytes_per_sample: float = 0.0
    """Saved-for-backward bytes per sample in fp32."""
    tp_sharded_activation_bytes_per_sample: float = 0.0
    """The part of ``activation_bytes_per_sample`` inside layers that tensor
    parallelism splits (attention and MLP), which divides by the tensor ways
    (0: unknown, nothing divides)."""
    largest_layer_parameters: int = 0
    """Biggest module's own parameters (FSDP gathers one unit at a time)."""
    blocks: int = 0
    """Blocks activation checkpointing (and FSDP2's units) would find (0: unknown)."""
    block_activation_bytes_per_sample: float = 0.0
    """The part of ``activation_bytes_per_sample`` saved inside those blocks (0: unknown)."""
    block_input_bytes_per_sample: float = 0.0
    """The blocks' inputs, fp32: what a checkpointed block keeps."""
    block_kept_bytes_per_sample: float = 0.0
    """Outputs of the blocks' matmuls and attention, fp32: what ``"selective"``
    checkpointing keeps besides the inputs (see :mod:`.recompute`)."""
    block_flops_per_sample: float = 0.0
    """The part of ``flops_per_sample`` inside the blocks (``"full"`` redoes a third)."""
    layers: int = 0
    hidden: int = 0
    seq_len: int = 0
    """Transformer shape, for tensor-parallel communication (0: unknown)."""
    expert_parameters: int = 0
    """A mixture of experts' parameters inside its experts, all layers (part of
    ``parameters``; 0: a dense model). Expert parallelism splits these."""
    num_experts: int = 0
    """Experts per MoE layer (expert parallelism's ways must divide it)."""
    experts_per_token: int = 0
    """The router's top-k: each token's copies sent to experts, per MoE layer."""
    moe_layers: int = 0
    """Layers with experts (0: every one of ``layers``)."""

    def __post_init__(self) -> None:
        if self.parameters < 1:
            raise UsageError(f"a model needs >= 1 parameter, got {self.parameters}")
        if self.flops_per_sample < 0 or self.activation_bytes_per_sample < 0:
            raise UsageError("FLOPs and activation bytes per sample must be >= 0")
        if not 0 <= self.tp_sharded_activation_bytes_per_sample <= self.activation_bytes_per_sample:
            raise UsageError("tensor-parallel activation bytes must be >= 0 and at most the total")
        if not 0 <= self.conv_flops_per_sample <= self.flops_per_sample:
            raise UsageError("convolution FLOPs must be >= 0 and at most the FLOPs per sample")
        if self.step_compute_s is not None and (self.step_compute_s <= 0 or self.compute_batch < 1):
            raise UsageError("a measured step time needs step_compute_s > 0 and compute_batch >= 1")
        if not 0 <= self.expert_parameters <= self.parameters:
            raise UsageError("expert parameters must be >= 0 and at most the parameters")
        if self.expert_parameters and not 1 <= self.experts_per_token <= self.num_experts:
            raise UsageError(
                "a mixture of experts needs num_experts >= 1 and 1 <= experts_per_token <= "
                f"num_experts, got {self.num_experts} and {self.experts_per_token}"
            )

    @property
    def routed_layers(self) -> int:
        """Layers whose tokens go to experts (0 for a dense model)."""
        return (self.moe_layers or self.layers) if self.expert_parameters else 0

    def compute_s(self, batch: int, matmul_tflops: float, conv_tflops: float) -> float:
        """Seconds of forward + backward + optimizer for ``batch`` samples on one device.

        A measured step scales with the batch; otherwise convolution FLOPs run at
        ``conv_tflops`` and the rest at ``matmul_tflops`` (achievable rates, which
        already include the optimizer, norms and memory traffic of such models).
        """
        if self.step_compute_s is not None:
            return self.step_compute_s * batch / self.compute_batch
        if self.flops_per_sample <= 0:
            raise UsageError(
                f"model {self.name!r}: give FLOPs per sample or a measured step time "
                "to estimate speed"
            )
        conv = self.conv_flops_per_sample
        per_sample = (self.flops_per_sample - conv) / matmul_tflops + conv / conv_tflops
        return per_sample * batch / 1e12


def transformer(
    name: str,
    *,
    parameters: int,
    layers: int,
    hidden: int,
    seq_len: int,
    heads: int = 0,
    vocab: int = 0,
    expert_parameters: int = 0,
    num_experts: int = 0,
    experts_per_token: int = 0,
) -> ModelDesc:
    """A decoder-only transformer from its shape (a mixture of experts with
    ``expert_parameters`` in ``num_experts`` experts per layer, ``experts_per_token`` each).

    FLOPs per token: 6 x parameters (Kaplan et al. 2020) plus 12 x layers x
    hidden x sequence for attention's two matmuls (the PaLM paper's appendix B,
    and nanoGPT's MFU), times the sequence. Activations: 34 x seq x hidden bytes
    per layer at 16 bits without recomputation, plus 5 x heads x seq^2 for
    attention scores when ``heads`` is given (Korthikanti et al. 2022; fused
    attention keeps no scores: leave ``heads`` 0); doubled for fp32. Of the
    34, 24 (and all the scores) are inside attention and the MLP, which tensor
    parallelism splits; the 10 of the norms' inputs and dropout masks are not
    (the same paper's equation 2, without sequence parallelism). With
    ``vocab``, the output layer's logits and the loss's log-softmax too
    (4 + 4 bytes per token and vocabulary entry in fp32), which for a small
    model with a large vocabulary (GPT-2 124M) is a third of the total.
    """
    split = 24 * seq_len * hidden + 5 * heads * seq_len * seq_len
    per_layer = 10 * seq_len * hidden + split
    logits = 8.0 * seq_len * vocab
    # Selective checkpointing keeps the matmuls' outputs: q, k, v, attention's
    # output, its projection, the MLP's 4h and h (10 x seq x hidden), and the
    # scores' matmul when attention is not fused; fp32 bytes.
    kept = 4.0 * (10 * seq_len * hidden + heads * seq_len * seq_len)
    attention_flops = 12.0 * layers * hidden * seq_len
    # A token computes with its top-k experts only: 6 x the active parameters.
    idle = expert_parameters * (1 - experts_per_token / num_experts) if num_experts else 0.0
    return ModelDesc(
        name=name,
        parameters=parameters,
        flops_per_sample=(6.0 * (parameters - idle) + attention_flops) * seq_len,
        activation_bytes_per_sample=2.0 * per_layer * layers + logits,
        tp_sharded_activation_bytes_per_sample=2.0 * split * layers,
        largest_layer_parameters=max(
            12 * hidden * hidden, vocab * hidden, expert_parameters // max(layers, 1)
        ),
        blocks=layers,
        block_activation_bytes_per_sample=2.0 * per_layer * layers,
        block_input_bytes_per_sample=4.0 * seq_len * hidden * layers,
        block_kept_bytes_per_sample=kept * layers,
        block_flops_per_sample=(72.0 * hidden * hidden * layers + attention_flops) * seq_len,
        layers=layers,
        hidden=hidden,
        seq_len=seq_len,
        expert_parameters=expert_parameters,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
    )


def saved_activation_bytes(
    model: nn.Module, x: torch.Tensor, loss: Callable[..., torch.Tensor], y: torch.Tensor
) -> int:
    """Bytes of distinct tensors autograd saves for backward during one forward."""
    seen: dict[tuple[int, int], int] = {}
    params = {p.data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:  # weights are counted as parameters, not activations
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = loss(model(x), y)
    out.backward()
    return sum(seen.values())


def describe(
    name: str,
    model: nn.Module,
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[..., torch.Tensor],
    *,
    sample_batch: int = 4,
    time_batch: int = 0,
) -> ModelDesc:
    """Measure a real model on the CPU; ``time_batch > 0`` also times a step (1 thread)."""
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(0)
    x, y = make_batch(sample_batch, gen)
    counter = FlopCounterMode(display=False)
    with counter:
        loss(model(x), y).backward()
    by_op = counter.get_flop_counts().get("Global", {})
    conv = sum(n for op, n in by_op.items() if "convolution" in str(op))
    acts = saved_activation_bytes(model, x, loss, y)
    inside = measure_blocks(model, x, loss, y)
    names = _block_names(model)
    counts = counter.get_flop_counts()
    block_flops = sum(sum(by.values()) for name, by in counts.items() if name in names)
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    step_s = measure_step_s(model, make_batch, loss, time_batch) if time_batch else None
    return ModelDesc(
        name=name,
        parameters=sum(p.numel() for p in model.parameters()),
        flops_per_sample=counter.get_total_flops() / sample_batch,
        conv_flops_per_sample=conv / sample_batch,
        step_compute_s=step_s,
        compute_batch=time_batch,
        activation_bytes_per_sample=acts / sample_batch,
        largest_layer_parameters=max(own, default=0),
        blocks=inside.blocks,
        block_activation_bytes_per_sample=inside.activation_bytes / sample_batch,
        block_input_bytes_per_sample=inside.input_bytes / sample_batch,
        block_kept_bytes_per_sample=inside.kept_bytes / sample_batch,
        block_flops_per_sample=min(block_flops, counter.get_total_flops()) / sample_batch,
    )


def _block_names(model: nn.Module) -> set[str]:
    """The blocks as the FLOP counter names them (``GPT.blocks.0``)."""
    from manygpu.transforms.blocks import find_blocks

    blocks = {id(b) for b in find_blocks(model)}
    root = type(model).__name__
    return {f"{root}.{n}" for n, m in model.named_modules() if id(m) in blocks}


def measure_step_s(
    model: nn.Module,
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[..., torch.Tensor],
    batch: int,
    steps: int = 6,
) -> float:
    """Median seconds of an Adam training step on one CPU thread (after 2 warm-up steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        x, y = make_batch(batch, torch.Generator().manual_seed(1))
        times = []
        for i in range(steps + 2):
            start = time.perf_counter()
            loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 2:
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[len(times) // 2]
