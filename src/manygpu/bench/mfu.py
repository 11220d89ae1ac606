"""Model FLOPs utilisation: FLOPs counted on one real step, over a GPU's peak.

MFU = achieved FLOP/s / peak FLOP/s, where achieved = (FLOPs of one training
step on one worker) x (steps per second of that worker). The count comes from
``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions, forward
and backward; element-wise work is not counted, as in the PaLM paper's MFU),
and is reported with the result so a reader can check it.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from manygpu.bench.models import Workload

# Dense peak TFLOP/s per GPU from the vendors' data sheets: (16-bit tensor core, fp32).
# fp32 is the plain FP32 rate: torch does not use TF32 for matmuls unless asked to.
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H100 PCIe": (756.0, 51.0),
    "H100": (989.0, 67.0),  # SXM (the name of an SXM part has no form factor)
    "H200": (989.0, 67.0),
    "A100": (312.0, 19.5),
    "V100": (125.0, 15.7),
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The table's peak for ``device_name`` (as CUDA names it), or ``None`` if unknown."""
    for key, (half, single) in PEAK_TFLOPS.items():
        parts = key.split()
        if all(part in device_name for part in parts):
            return half if precision in ("bf16", "fp16") else single
    return None


def step_flops(workload: Workload, batch: int, device: torch.device) -> int:
    """FLOPs of one forward + backward of ``workload`` on ``batch`` samples.

    Runs on a throw-away copy of the model so the benchmarked one keeps its
    state (and DDP never sees an extra backward on one rank only).
    """
    import copy

    model = copy.deepcopy(workload.model).to(device)
    gen = torch.Generator().manual_seed(0)
    x, y = workload.make_batch(batch, gen)
    x, y = x.to(device), y.to(device)
    counter = FlopCounterMode(display=False)
    with counter:
        workload.loss(model(x), y).backward()
    return int(counter.get_total_flops())


def mfu(flops_per_step: int, steps_per_s: float, peak: float | None) -> float | None:
    """Achieved / peak, or ``None`` when the peak is unknown (CPUs)."""
    if not peak or flops_per_step <= 0:
        return None
    return flops_per_step * steps_per_s / (peak * 1e12)
