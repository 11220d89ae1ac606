"""Published results, as data, to check the planner against: scaling and single-device speed.

Each case is the set-up a paper or vendor page reports (model, per-GPU batch,
single-GPU throughput, GPUs and network) and the efficiency it measured. The
planner gets the set-up only and must land near the result. Parameter counts:
ResNet-50 25.6 M, ResNet-101 44.5 M, Inception V3 23.8 M, VGG-16 138 M.

Sources and what we read from them:

* Horovod (Sergeev & Del Balso, arXiv:1802.05799, and the Horovod README):
  128 servers x 4 Pascal GPUs on 25 Gbit/s RoCE (512 GPUs), TensorFlow's
  tf_cnn_benchmarks with its default batch of 64 per GPU; "90% scaling
  efficiency for both Inception V3 and ResNet-101, and 68% for VGG-16".
  Gradients fp32; tensor fusion buffer 64 MB. Single-GPU images/s are
  TensorFlow's published tf_cnn_benchmarks numbers for P100 (synthetic data,
  batch 64): Inception V3 142, VGG-16 154, ResNet-50 238, ResNet-152 95.6;
  ResNet-101 (not in that table) interpolated by FLOPs between ResNet-50
  (3.9 GFLOPs) and ResNet-152 (11.3): 7.6 GFLOPs -> 136 images/s.
* PyTorch DDP (Li et al., VLDB 2020, arXiv:2006.15704): ResNet-50 on 16 V100
  (2 servers x 8, NVLink inside) keeps about 93% of per-GPU throughput with
  NCCL. Per-GPU batch (32) and a single 100 Gbit/s link between the servers
  are our reading of the set-up; DDP's 25 MB buckets; fp32.
* NVIDIA DeepLearningExamples, ResNet-50 v1.5 for PyTorch, "Training
  performance: NVIDIA DGX-1 16GB (8x V100 16GB)": FP32 367 -> 2855 images/s
  (7.76x) and mixed precision 1200 -> 8322 images/s (6.93x, the "close to 7x"
  figure). Batch per GPU 112 (FP32) and 256 (mixed), the recipe's defaults;
  torch AMP keeps fp32 gradients, so 4 bytes per parameter go on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from manygpu.plan.desc import ModelDesc, transformer
from manygpu.plan.devices import DEVICES, RESNET50_TRAIN_FLOPS
from manygpu.plan.hardware import PRESETS, Cluster
from manygpu.plan.perf import StepEstimate, estimate


@dataclass(frozen=True, kw_only=True)
class PublishedCase:
    """A published set-up and the scaling efficiency it reported."""

    name: str
    source: str
    parameters: int
    batch: int
    single_gpu_samples_per_s: float
    cluster: Cluster
    bucket_mb: float
    published_efficiency: float
    """Throughput / (GPUs x single-GPU throughput), as published."""

    def predict(self) -> StepEstimate:
        """The planner's prediction from the set-up alone (same formulas for every case)."""
        desc = ModelDesc(
            name=self.name,
            parameters=self.parameters,
            step_compute_s=self.batch / self.single_gpu_samples_per_s,
            compute_batch=self.batch,
        )
        return estimate(desc, self.cluster, "ddp", batch=self.batch, bucket_mb=self.bucket_mb,
                        grad_bytes=4.0)  # fmt: skip


_HOROVOD = PRESETS["p100-roce25"].with_size(nodes=128)
_DGX1 = PRESETS["v100"]
_DDP_PAPER = replace(PRESETS["v100"], nodes=2, inter_bw_gbs=100 / 8)
_HOROVOD_SRC = "Horovod, arXiv:1802.05799 / README (512 P100, 25 Gbit/s RoCE)"
_DLE_SRC = "NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch, DGX-1 8x V100 16GB"

CASES: tuple[PublishedCase, ...] = (
    PublishedCase(name="horovod-resnet101", source=_HOROVOD_SRC, parameters=44_500_000,
                  batch=64, single_gpu_samples_per_s=136.0, cluster=_HOROVOD, bucket_mb=64,
                  published_efficiency=0.90),
    PublishedCase(name="horovod-inception3", source=_HOROVOD_SRC, parameters=23_800_000,
                  batch=64, single_gpu_samples_per_s=142.0, cluster=_HOROVOD, bucket_mb=64,
                  published_efficiency=0.90),
    PublishedCase(name="horovod-vgg16", source=_HOROVOD_SRC, parameters=138_000_000,
                  batch=64, single_gpu_samples_per_s=154.0, cluster=_HOROVOD, bucket_mb=64,
                  published_efficiency=0.68),
    PublishedCase(name="ddp-paper-resnet50-16gpu",
                  source="PyTorch DDP, VLDB 2020, arXiv:2006.15704 (16 V100)",
                  parameters=25_600_000, batch=32, single_gpu_samples_per_s=367.0,
                  cluster=_DDP_PAPER, bucket_mb=25, published_efficiency=0.93),
    PublishedCase(name="dgx1-resnet50-fp32", source=_DLE_SRC, parameters=25_600_000,
                  batch=112, single_gpu_samples_per_s=367.0, cluster=_DGX1, bucket_mb=25,
                  published_efficiency=2855 / (8 * 367)),
    PublishedCase(name="dgx1-resnet50-amp", source=_DLE_SRC, parameters=25_600_000,
                  batch=256, single_gpu_samples_per_s=1200.0, cluster=_DGX1, bucket_mb=25,
                  published_efficiency=8322 / (8 * 1200)),
)  # fmt: skip
"""Every case, in the order of the docstring."""


# --- models, described without building them ------------------------------------------------


def resnet50() -> ModelDesc:
    """ResNet-50 v1.5 (torchvision's layout) on 224x224 images, 1000 classes.

    Measured with :func:`~manygpu.plan.desc.describe` on the CPU (the unit
    tests build the model and measure it again): 24.3 GFLOP per image forward
    + backward, all but 12 MFLOP in convolutions; 86 MB saved for backward per
    image in fp32; the largest module is a 3x3 convolution of 512 channels.
    """
    return ModelDesc(
        name="resnet50", parameters=25_557_032, flops_per_sample=RESNET50_TRAIN_FLOPS,
        conv_flops_per_sample=RESNET50_TRAIN_FLOPS - 12.3e6,
        activation_bytes_per_sample=86.1e6, largest_layer_parameters=2_359_296,
    )  # fmt: skip


def gpt2() -> ModelDesc:
    """GPT-2 small (124M, 12 x 768, 12 heads, sequence 1024, vocabulary 50,257, tied head)."""
    return transformer("gpt2", parameters=124_439_808, layers=12, hidden=768, seq_len=1024,
                       vocab=50_257)  # fmt: skip


def gpt2_medium() -> ModelDesc:
    """GPT-2 medium (355M, 24 x 1024, 16 heads, sequence 1024, vocabulary 50,257)."""
    return transformer("gpt2-medium", parameters=354_823_168, layers=24, hidden=1024,
                       seq_len=1024, vocab=50_257)  # fmt: skip


def _cnn(name: str, parameters: int, gmacs: float) -> ModelDesc:
    """A conv net from torchvision's documented multiply-adds per image (forward):
    2 FLOPs each, times 3 for forward + backward."""
    flops = 6 * gmacs * 1e9
    return ModelDesc(name=name, parameters=parameters, flops_per_sample=flops,
                     conv_flops_per_sample=flops)  # fmt: skip


MODELS: dict[str, Callable[[], ModelDesc]] = {
    "resnet50": resnet50,
    "gpt2": gpt2,
    "gpt2-medium": gpt2_medium,
}
"""Models ``manygpu plan --model`` knows by name without measuring them."""


# --- single-device throughput ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DeviceCase:
    """A published training throughput on one device, in the source's own unit."""

    name: str
    source: str
    model: ModelDesc
    device: str
    """Key in :data:`manygpu.plan.devices.DEVICES`."""
    precision: str
    batch: int
    published: float
    """Images/s, or tokens/s for language models (``per_sample`` tokens a sample)."""
    per_sample: int = 1
    calibrates: bool = False
    """Whether a fraction in :mod:`manygpu.plan.devices` was derived from this figure
    (then the case checks that derivation; the others are predictions)."""
    known_gap: str = ""
    """Why the planner is expected to miss this one (non-empty: a strict expected failure)."""

    def predict(self) -> float:
        """The planner's throughput on one device, in the same unit as ``published``."""
        device = DEVICES[self.device]
        step = self.model.compute_s(
            self.batch,
            device.achievable_tflops(self.precision, "matmul"),
            device.achievable_tflops(self.precision, "conv"),
        )
        return self.batch * self.per_sample / step


_DLE_V100 = "NVIDIA DeepLearningExamples, ResNet-50 v1.5 PyTorch, DGX-1 16GB, 1 GPU"
_DLE_V100_32 = "NVIDIA DeepLearningExamples, ResNet-50 v1.5 PyTorch, DGX-1 32GB, 1 GPU"
_DLE_A100 = "NVIDIA DeepLearningExamples, ResNet-50 v1.5 PyTorch, DGX A100 80GB, 1 GPU"
_ISSUE = "manygpu issue 14: one H100 SXM 80GB, torch 2.11+cu130"
_TF_CNN = "TensorFlow tf_cnn_benchmarks, P100, synthetic data (Horovod README's baseline)"
_NCHW = (
    "the NCHW run: cuDNN's bf16 convolutions transpose every input and output to NHWC; "
    "the planner times the channels_last recipe (2,613) that manygpu's defaults follow"
)
_WINOGRAD = (
    "cuDNN runs VGG's 3x3 convolutions with Winograd transforms, in fewer multiplies "
    "than the FLOP count: 154 img/s x 93 GFLOP is 14 TFLOP/s, above the P100's 9.3 peak"
)
_INCEPTION = (
    "Inception V3's factorised 1x7 / 7x1 and narrow 1x1 branches reach 84% of "
    "ResNet-50's FLOP rate on the same GPU; one conv rate per device cannot see it"
)

DEVICE_CASES: tuple[DeviceCase, ...] = (
    DeviceCase(name="v100-resnet50-fp32", source=_DLE_V100, model=resnet50(), device="v100",
               precision="fp32", batch=112, published=367, calibrates=True),
    DeviceCase(name="v100-resnet50-amp", source=_DLE_V100, model=resnet50(), device="v100",
               precision="fp16", batch=256, published=1200, calibrates=True),
    DeviceCase(name="v100-32gb-resnet50-fp32", source=_DLE_V100_32, model=resnet50(),
               device="v100", precision="fp32", batch=112, published=356),
    DeviceCase(name="v100-32gb-resnet50-amp", source=_DLE_V100_32, model=resnet50(),
               device="v100", precision="fp16", batch=256, published=1156),
    DeviceCase(name="a100-resnet50-tf32", source=_DLE_A100, model=resnet50(), device="a100",
               precision="tf32", batch=256, published=938, calibrates=True),
    DeviceCase(name="a100-resnet50-amp", source=_DLE_A100, model=resnet50(), device="a100",
               precision="fp16", batch=256, published=2470, calibrates=True),
    DeviceCase(name="h100-resnet50-fp32", source=_ISSUE + ", Parallel() fp32 (TF32 convolutions)",
               model=resnet50(), device="h100", precision="tf32", batch=128, published=1751,
               calibrates=True),
    DeviceCase(name="h100-resnet50-bf16-hand-tuned", source=_ISSUE + ", channels_last + bf16 + "
               "fused AdamW + TF32", model=resnet50(), device="h100", precision="bf16",
               batch=128, published=2613, calibrates=True),
    DeviceCase(name="h100-resnet50-bf16", source=_ISSUE + ', Parallel(precision="bf16"), NCHW',
               model=resnet50(), device="h100", precision="bf16", batch=128, published=2087,
               known_gap=_NCHW),
    DeviceCase(name="h100-gpt2-bf16", source=_ISSUE + ', Parallel(precision="bf16")',
               model=gpt2(), device="h100", precision="bf16", batch=16, published=353_033,
               per_sample=1024, calibrates=True),
    DeviceCase(name="h100-gpt2-fp32", source=_ISSUE + ", Parallel() fp32", model=gpt2(),
               device="h100", precision="fp32", batch=16, published=53_647, per_sample=1024,
               calibrates=True),
    DeviceCase(name="h100-gpt2-bf16-hand-tuned", source=_ISSUE + ", TF32 + bf16 autocast + "
               "fused AdamW", model=gpt2(), device="h100", precision="bf16", batch=16,
               published=342_408, per_sample=1024),
    DeviceCase(name="h100-gpt2-fp32-classic", source=_ISSUE + ", fp32 nn.DataParallel",
               model=gpt2(), device="h100", precision="fp32", batch=16, published=53_439,
               per_sample=1024),
    DeviceCase(name="p100-resnet50", source=_TF_CNN, model=resnet50(), device="p100",
               precision="fp32", batch=64, published=238, calibrates=True),
    DeviceCase(name="p100-resnet152", source=_TF_CNN, model=_cnn("resnet152", 60_192_808, 11.51),
               device="p100", precision="fp32", batch=64, published=95.6),
    DeviceCase(name="p100-inception3", source=_TF_CNN, model=_cnn("inception3", 27_161_264, 5.71),
               device="p100", precision="fp32", batch=64, published=142, known_gap=_INCEPTION),
    DeviceCase(name="p100-vgg16", source=_TF_CNN, model=_cnn("vgg16", 138_357_544, 15.47),
               device="p100", precision="fp32", batch=64, published=154, known_gap=_WINOGRAD),
)  # fmt: skip
"""Single-device figures: the ones the device table was derived from, and predictions."""
