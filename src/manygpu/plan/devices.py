"""What one device achieves in training, per precision: data-sheet peaks times measured fractions.

A data sheet's peak is what no training step reaches: ResNet-50 on a V100 in
fp32 runs at 57% of it, in mixed precision at 23% (the tensor cores finish
their part so fast that batch norm, activations and memory traffic dominate),
and the gap widens with every generation (19% on an A100, 6% on an H100).
So the planner times a step with *achievable* rates: per device and
precision, the fraction of the peak that published training runs reach, for
two kinds of work that behave differently:

* ``conv``: convolutional nets with their batch norm and activations, from
  ResNet-50 training throughput (24.3 GFLOP per 224x224 image, forward and
  backward, as ``FlopCounterMode`` counts it);
* ``matmul``: transformers (linear layers and attention), from GPT-2 124M
  training throughput (860 MFLOP per token: 6 x 124.4M parameters plus
  12 x layers x hidden x sequence for attention, the PaLM paper's convention,
  which is also how the MFU figures below were computed).

Every fraction below names its source. Where no single-device figure was
found for a device, the fraction of the closest measured device with the same
kind of math units is reused and the comment says so; those entries are
assumptions, not measurements. ``tests/unit/test_plan_throughput.py`` checks
predictions against every figure (and against others that were not used to
derive anything).

Precisions: ``fp32`` is IEEE fp32 math on the CUDA cores; ``tf32`` keeps fp32
tensors but multiplies on tensor cores (what cuDNN does for convolutions by
default on Ampere and newer, and what torch does for matmuls when asked);
``bf16`` / ``fp16`` are mixed precision (autocast). A precision the device has
no math for (bf16 on a V100, tf32 before Ampere) is not in its table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from manygpu.errors import UsageError

Kind = Literal["matmul", "conv"]
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
"""The precisions a step can be timed at (``auto`` resolves to one per device)."""
ALIASES = {"fp32-strict": "fp32"}
"""Other names for the same math: fp32 with TF32 switched off is IEEE fp32."""

RESNET50_TRAIN_FLOPS = 24.3e9
"""Forward + backward FLOPs of ResNet-50 (v1.5) per 224x224 image, ``FlopCounterMode``."""
GPT2_TRAIN_FLOPS_PER_TOKEN = 6 * 124_439_808 + 12 * 12 * 768 * 1024
"""GPT-2 124M (12 x 768, sequence 1024): 860 MFLOP per token, forward + backward."""


# Dense peaks (no sparsity), TFLOP/s, from NVIDIA data sheets (Tesla P100 PCIe; V100 SXM2; T4;
# A100 SXM4 80GB; H100 SXM5 and PCIe; H200 SXM, whose TF32 / bf16 / fp16 figures are given with
# 2:4 sparsity and halved here). The one home of these figures: the planner's devices below take
# theirs from here, and so does the MFU of ``bench`` (manygpu.bench.mfu). Keyed by the words a
# CUDA device name contains ("NVIDIA H100 PCIe"); the key with the most words wins.
DATA_SHEETS: dict[str, dict[str, float]] = {
    "P100": {"fp32": 9.3, "fp16": 18.7},
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "T4": {"fp32": 8.1, "fp16": 65.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0, "fp16": 989.0},  # SXM: no form factor
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},  # in its name
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0, "fp16": 989.0},
}


def data_sheet(gpu_name: str) -> Mapping[str, float] | None:
    """Dense peak TFLOP/s per precision the GPU has math for, or ``None`` if not in the table.

    The most specific key wins, so an "H100 PCIe" is not taken for the SXM part.
    """
    upper = gpu_name.upper()
    hits = [key for key in DATA_SHEETS if all(w in upper for w in key.upper().split())]
    return DATA_SHEETS[max(hits, key=lambda k: len(k.split()))] if hits else None


# The sheets the measured fractions below are taken against.
_V100, _A100, _H100 = DATA_SHEETS["V100"], DATA_SHEETS["A100"], DATA_SHEETS["H100"]


def _fraction(samples_per_s: float, flops_per_sample: float, peak_tflops: float) -> float:
    """Achieved / peak of a published throughput."""
    return samples_per_s * flops_per_sample / (peak_tflops * 1e12)


# --- conv nets: ResNet-50 training, images/s on one device -----------------------------------
# NVIDIA DeepLearningExamples, ResNet-50 v1.5 for PyTorch (pytorch-21.03 container), training
# performance, 1 GPU: DGX-1 16GB V100 FP32 367 img/s and mixed precision 1,200 img/s; DGX A100
# 80GB TF32 938 img/s and mixed precision 2,470 img/s.
V100_CONV_FP32 = _fraction(367, RESNET50_TRAIN_FLOPS, _V100["fp32"])  # 57%
V100_CONV_16BIT = _fraction(1200, RESNET50_TRAIN_FLOPS, _V100["fp16"])  # 23%
A100_CONV_TF32 = _fraction(938, RESNET50_TRAIN_FLOPS, _A100["tf32"])  # 15%
A100_CONV_16BIT = _fraction(2470, RESNET50_TRAIN_FLOPS, _A100["bf16"])  # 19%
# TensorFlow tf_cnn_benchmarks, P100, synthetic data, batch 64: ResNet-50 238 img/s.
P100_CONV_FP32 = _fraction(238, RESNET50_TRAIN_FLOPS, DATA_SHEETS["P100"]["fp32"])  # 62%
# One H100 SXM 80GB, torch 2.11 + cu130, batch 128 (issue 14's table): fp32 (cuDNN's default
# TF32 convolutions) 1,751 img/s; bf16 + channels_last + fused AdamW + TF32 2,613 img/s (the
# recipe manygpu's defaults follow; the same run in NCHW reached 2,087, see the tests).
H100_CONV_TF32 = _fraction(1751, RESNET50_TRAIN_FLOPS, _H100["tf32"])  # 8.6%
H100_CONV_16BIT = _fraction(2613, RESNET50_TRAIN_FLOPS, _H100["bf16"])  # 6.4%

# --- transformers: GPT-2 124M training, tokens/s on one device ---------------------------------
# One H100 SXM 80GB, torch 2.11 + cu130, batch 16 x 1024, AdamW (issue 14's table):
# Parallel(precision="bf16") 353,033 tokens/s (30.5% MFU); Parallel() in fp32 53,647.
TENSOR_MATMUL = _fraction(353_033, GPT2_TRAIN_FLOPS_PER_TOKEN, _H100["bf16"])  # 31%
CUDA_CORE_MATMUL = _fraction(53_647, GPT2_TRAIN_FLOPS_PER_TOKEN, _H100["fp32"])  # 69%
# No single-device GPT figure for the other GPUs in our sources: their matmul fractions
# reuse these two (tensor-core math / CUDA-core math); assumptions, not measurements.

# --- CPUs: one process, measured here -------------------------------------------------------
# BENCHMARKS.md, "Training scaling 1 -> 2 processes" (dev-2c): one 1-thread process trains the
# resnet workload (0.63 GFLOP per sample) at 139 samples/s and gpt (0.32 GFLOP) at 206, against
# a 161 GFLOP/s matmul probe: 55% and 40% of what the probe reaches.
CPU_CONV = _fraction(139, 0.633e9, 0.161)
CPU_MATMUL = _fraction(206, 0.315e9, 0.161)


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator: memory, data-sheet peaks, and the fractions training reaches."""

    name: str
    memory_gb: float
    """Memory per device, GB (1e9 bytes)."""
    peak_tflops: Mapping[str, float]
    """Dense peak (no sparsity) per precision, from the vendor's data sheet."""
    conv_fraction: Mapping[str, float]
    """Achieved / peak for convolutional nets, per precision."""
    matmul_fraction: Mapping[str, float]
    """Achieved / peak for transformers, per precision."""

    def __post_init__(self) -> None:
        for table in (self.conv_fraction, self.matmul_fraction):
            if set(table) != set(self.peak_tflops):
                raise UsageError(f"device {self.name}: every precision needs a peak and fractions")
            if not all(0 < f <= 1 for f in table.values()):
                raise UsageError(f"device {self.name}: fractions of the peak must be in (0, 1]")

    def achievable_tflops(self, precision: str, kind: Kind) -> float:
        """TFLOP/s one training step reaches at ``precision`` for work of ``kind``."""
        self.check(precision)
        fraction = self.conv_fraction if kind == "conv" else self.matmul_fraction
        return self.peak_tflops[precision] * fraction[precision]

    def check(self, precision: str) -> None:
        if precision not in self.peak_tflops:
            raise UsageError(
                f"the {self.name} has no {precision} math; plan with "
                f"{', '.join(self.peak_tflops)} or 'auto'"
            )

    @property
    def auto_precision(self) -> str:
        """What ``precision="auto"`` trains with here: bf16, else fp16, else fp32."""
        return next(p for p in ("bf16", "fp16", "fp32") if p in self.peak_tflops)


def _gpu(name: str, memory_gb: float, sheet: str, conv: dict[str, float]) -> Device:
    """A GPU planned at the precisions it has conv fractions for, with the data sheet's peaks.

    Its matmul fractions are the measured tensor-core / CUDA-core ones.
    """
    peaks = {p: DATA_SHEETS[sheet][p] for p in conv}
    matmul = {p: CUDA_CORE_MATMUL if p == "fp32" else TENSOR_MATMUL for p in peaks}
    return Device(
        name=name, memory_gb=memory_gb, peak_tflops=peaks, conv_fraction=conv,
        matmul_fraction=matmul,
    )  # fmt: skip


DEVICES: dict[str, Device] = {
    # Pascal has no tensor cores: fp16 brings no speed the table could vouch for, so fp32 only.
    "p100": _gpu("P100 PCIe 16GB", 16, "P100", {"fp32": P100_CONV_FP32}),
    "v100": _gpu("V100 SXM2 16GB", 16, "V100", {"fp32": V100_CONV_FP32, "fp16": V100_CONV_16BIT}),
    # Turing's tensor cores are Volta's: no single-T4 training figure here, so the V100's
    # conv fractions (assumed).
    "t4": _gpu("T4 16GB", 16, "T4", {"fp32": V100_CONV_FP32, "fp16": V100_CONV_16BIT}),
    # fp32 with TF32 off: no figure; the V100's CUDA-core fraction (assumed).
    "a100": _gpu("A100 SXM4 80GB", 80, "A100",
                 {"fp32": V100_CONV_FP32, "tf32": A100_CONV_TF32, "bf16": A100_CONV_16BIT,
                  "fp16": A100_CONV_16BIT}),
    # fp32 with TF32 off: no figure; the V100's CUDA-core fraction (assumed).
    "h100": _gpu("H100 SXM5 80GB", 80, "H100",
                 {"fp32": V100_CONV_FP32, "tf32": H100_CONV_TF32, "bf16": H100_CONV_16BIT,
                  "fp16": H100_CONV_16BIT}),
}  # fmt: skip
"""Known devices by short name (the cluster presets use them)."""


def cpu_device(matmul_tflops: float, memory_gb: float) -> Device:
    """One CPU process whose 1-thread-per-worker matmul probe reached ``matmul_tflops``."""
    return Device(
        name="CPU process", memory_gb=memory_gb, peak_tflops={"fp32": matmul_tflops},
        conv_fraction={"fp32": CPU_CONV}, matmul_fraction={"fp32": CPU_MATMUL},
    )  # fmt: skip


def find(gpu_name: str) -> Device | None:
    """The table's device for a CUDA device name (e.g. "NVIDIA H100 80GB HBM3"), if known."""
    upper = gpu_name.upper()
    return next((d for key, d in DEVICES.items() if key.upper() in upper), None)


def resolve_precision(precision: str, device: Device | None) -> str:
    """``precision`` as one of :data:`PRECISIONS`, checked against ``device``.

    ``auto`` is bf16 where the device has it, else fp16 (V100, T4), else fp32
    (CPUs, or a cluster described by a bare peak).
    """
    name = ALIASES.get(precision, precision)
    if name == "auto":
        return "fp32" if device is None else device.auto_precision
    if name not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}; choose auto, {', '.join(PRECISIONS)}")
    if device is not None:
        device.check(name)
    return name
