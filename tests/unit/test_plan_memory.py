"""The planner's memory model: bytes per parameter, sharding, a real model's bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from manygpu.errors import UsageError
from manygpu.plan import memory
from manygpu.plan.desc import ModelDesc, describe, transformer

P = 1_000_000


def _desc(**kw: object) -> ModelDesc:
    return ModelDesc(name="m", parameters=P, **kw)  # type: ignore[arg-type]


def test_adam_fp32_ddp_is_16_bytes_per_parameter() -> None:
    est = memory.estimate(_desc(), "ddp", world=8, batch=1)
    assert (est.params, est.grads, est.optimizer) == (4 * P, 4 * P, 8 * P)
    assert est.total == 16 * P


def test_zero_stages_shard_over_n() -> None:
    n = 8
    z1 = memory.estimate(_desc(), "zero1", world=n, batch=1)
    z2 = memory.estimate(_desc(), "zero2", world=n, batch=1)
    z3 = memory.estimate(_desc(), "fsdp", world=n, batch=1)
    assert z1.total == pytest.approx(4 * P + 4 * P + 8 * P / n)
    # FSDP2's ZeRO-2: sharded fp32 state, plus every unit gathered from forward to backward.
    assert z2.held == pytest.approx(16 * P / n) and z2.gathered == 4 * P
    assert z3.total == pytest.approx(16 * P / n)  # no layer size given: nothing gathered
    gathered = memory.estimate(_desc(largest_layer_parameters=1000), "fsdp", world=n, batch=1)
    assert gathered.total == pytest.approx(16 * P / n + 2 * 1000 * 4)


def test_mixed_precision_is_autocast_over_fp32_weights() -> None:
    """manygpu's bf16 keeps fp32 weights, grads and Adam state (no master copy), and
    autocast's 16-bit weight copies live from forward to backward."""
    b = memory.bytes_per_param("bf16", "adam")
    assert (b.weights, b.grads, b.optimizer, b.total, b.compute) == (4, 4, 8, 16, 2)
    z1 = memory.estimate(_desc(activation_bytes_per_sample=100.0), "zero1", world=4,
                         batch=2, precision="bf16")  # fmt: skip
    assert z1.params + z1.grads == 8 * P and z1.optimizer == 8 * P / 4
    assert z1.gathered == 2 * P  # the autocast copies, whole
    assert z1.activations == 100.0  # 2 samples x 100 B at fp32, halved for bf16
    assert memory.bytes_per_param("fp32", "sgd").total == 8


def test_16_bit_fsdp_gathers_16_bit_units_over_fp32_shards() -> None:
    """FSDP(param_dtype="bf16"): the shards, grads and Adam state stay fp32; only the
    gathered copies are 16-bit, and autocast finds nothing to cast."""
    d = _desc(largest_layer_parameters=1000)
    z3 = memory.estimate(d, "fsdp", world=8, batch=1, precision="bf16")
    assert z3.held == pytest.approx(16 * P / 8) and z3.gathered == 2 * 1000 * 2
    z2 = memory.estimate(d, "zero2", world=8, batch=1, precision="bf16")
    assert z2.held == pytest.approx(16 * P / 8) and z2.gathered == 2 * P
    tp = memory.estimate(d, "tensor", world=8, batch=1, stages=4, precision="bf16")
    assert tp.held == 16 * P / 4 and tp.gathered == 2 * P / 4  # its shard's autocast copies


def test_pipeline_and_tensor_split_states() -> None:
    d = _desc(activation_bytes_per_sample=1000.0)
    pp = memory.estimate(d, "pipeline", world=8, batch=2, stages=4, microbatches=16)
    tp = memory.estimate(d, "tensor", world=8, batch=2, stages=2)
    # Per-device batch 2: a 4-stage replica trains 8 samples, 4 of 16 micro-batches in flight,
    # each stage holding a quarter of the layers -> 8 x 1000 x 4/16 / 4 ... = 2 x 1000 / 4.
    assert pp.total == pytest.approx(16 * P / 4 + 2 * 1000 / 4)
    assert tp.total == pytest.approx(16 * P / 2 + 2 * 1000)  # nothing known to be TP-split


def test_tensor_parallel_divides_the_activations_of_the_layers_it_splits() -> None:
    d = transformer("t", parameters=P, layers=2, hidden=64, seq_len=16)
    whole = memory.estimate(d, "ddp", world=8, batch=1).activations
    tp = memory.estimate(d, "tensor", world=8, batch=1, stages=4).activations
    # Per layer 34 x s x h bytes at 16 bits: 24 inside attention and the MLP divide by 4.
    assert whole == 2 * 34 * 16 * 64 * 2
    assert tp == pytest.approx(2 * (10 + 24 / 4) * 16 * 64 * 2)


def test_bad_names() -> None:
    with pytest.raises(UsageError, match="unknown strategy"):
        memory.estimate(_desc(), "zero9", world=2, batch=1)
    with pytest.raises(UsageError, match="unknown optimizer"):
        memory.bytes_per_param("fp32", "lion")
    with pytest.raises(UsageError, match="parameter"):
        ModelDesc(name="m", parameters=0)


def test_estimate_matches_a_real_model_and_adam_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)

    desc = describe("mlp", model, batch, nn.functional.cross_entropy)
    est = memory.estimate(desc, "ddp", world=2, batch=4)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.params == weights and est.grads == weights
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if v.dim() > 0)  # fmt: skip
    assert est.optimizer == state
    assert desc.largest_layer_parameters == 128 * 64 + 128
    # Saved for backward per sample: the input (64), the hidden pre/post ReLU (128 each,
    # shared storage where autograd keeps one), the logits' input (128) -- in floats.
    assert 64 * 4 <= desc.activation_bytes_per_sample <= (64 + 3 * 128 + 10) * 4
    # Forward and weight gradients: 2 x 2 x (64x128 + 128x10); input gradient of layer 2 only.
    assert desc.flops_per_sample == 2 * 2 * (64 * 128 + 128 * 10) + 2 * 128 * 10


def test_transformer_description() -> None:
    d = transformer("7b", parameters=7_000_000_000, layers=32, hidden=4096, seq_len=2048)
    # 6 N per token plus attention's 12 x layers x hidden x sequence (PaLM, appendix B).
    assert d.flops_per_sample == (6 * 7e9 + 12 * 32 * 4096 * 2048) * 2048
    assert d.activation_bytes_per_sample == 2 * 34 * 2048 * 4096 * 32
    assert d.conv_flops_per_sample == 0
    # With a vocabulary: the logits and the loss's log-softmax, 4 + 4 bytes each in fp32.
    v = transformer("v", parameters=10**6, layers=1, hidden=64, seq_len=16, vocab=1000)
    assert v.activation_bytes_per_sample == 2 * 34 * 16 * 64 + 8 * 16 * 1000
    assert v.largest_layer_parameters == 1000 * 64  # the embedding outgrows a block


def test_tf32_stores_fp32_and_16_bit_halves_activations() -> None:
    d = _desc(activation_bytes_per_sample=1000.0)
    fp32, tf32, bf16 = (memory.estimate(d, "ddp", world=2, batch=4, precision=p)
                        for p in ("fp32", "tf32", "bf16"))  # fmt: skip
    assert fp32 == tf32 and fp32.activations == 4000.0 and bf16.activations == 2000.0
    with pytest.raises(UsageError, match="unknown precision 'auto'"):
        memory.bytes_per_param("auto", "adam")  # resolved per device by the planner first


def test_a_real_model_counts_its_convolution_flops() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 2))

    def batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 2, (n,), generator=g)

    d = describe("cnn", model, batch, nn.functional.cross_entropy, sample_batch=2)
    # Forward: 2 x (8 out x 6 x 6 positions x 27 taps); backward: the weight gradient only
    # (no layer before it needs an input gradient) = the forward again.
    conv_fwd = 2 * 8 * 6 * 6 * 27
    assert d.conv_flops_per_sample == 2 * conv_fwd
    # The linear layer: forward, weight gradient and input gradient (the conv needs it).
    assert d.flops_per_sample == d.conv_flops_per_sample + 3 * (2 * 288 * 2)


def test_prepare_peaks_at_the_kept_weights_plus_one_module_in_flight() -> None:
    """prepare holds what the device keeps of the weights and one module whole (an
    init twin or a tensor read from a file), no gradients or optimizer state yet."""
    desc = _desc(largest_layer_parameters=50_000)
    fsdp = memory.estimate(desc, "fsdp", world=8, batch=1, optimizer="sgd")
    assert fsdp.prepare == pytest.approx(4 * P / 8 + 4 * 50_000)
    ddp = memory.estimate(desc, "ddp", world=8, batch=1, optimizer="sgd")
    assert ddp.prepare == pytest.approx(4 * P + 4 * 50_000)
    assert ddp.peak == max(ddp.total, ddp.prepare)
    # A device that holds the step but not prepare's peak does not fit.
    est = memory.MemoryEstimate(strategy="fsdp", params=1e9, grads=1e9, optimizer=0,
                                activations=0, prepare=3e9)  # fmt: skip
    assert est.peak == 3e9 and est.fits(3.4) and not est.fits(3.0)  # 2.7 GB: the step fits


def test_a_model_past_one_device_is_told_to_build_under_init_module() -> None:
    big = ModelDesc(name="m", parameters=20 * 10**9)  # 80 GB of fp32 weights
    note = memory.init_module_note(big, memory_gb=80, processes_per_node=8)
    assert note is not None and "par.init_module()" in note and "640.0 GB of host memory" in note
    assert memory.init_module_note(_desc(), memory_gb=80, processes_per_node=8) is None
