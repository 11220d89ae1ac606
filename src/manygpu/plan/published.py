"""Published scaling results, as data, to check the planner against.

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

from dataclasses import dataclass, replace

from manygpu.plan.desc import ModelDesc
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
