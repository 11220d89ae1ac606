"""Model FLOPs utilisation: FLOPs counted on one real step, over a GPU's peak.

MFU = achieved FLOP/s / peak FLOP/s, where achieved = (FLOPs of one training
step on one worker) x (steps per second of that worker). The count comes from
``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions, forward
and backward; element-wise work is not counted, as in the PaLM paper's MFU),
and is reported with the result so a reader can check it.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.flop_counter import FlopCounterMode

from manygpu.bench.models import Workload
from manygpu.plan.devices import data_sheet


def peak_tflops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The peak that bounds a run: 16-bit for bf16/fp16, TF32 or plain fp32 otherwise.

    From the data sheets in :mod:`manygpu.plan.devices` (the planner's figures
    too); ``None`` for a device not in them (CPUs). A 16-bit precision the GPU
    lacks (bf16 on a V100) gets its fp16 tensor-core peak: one 16-bit reference
    per GPU. ``tf32`` says whether fp32 matmuls (and convolutions) ran as TF32,
    which doubles-to-sevenfolds the ceiling; using the plain fp32 rate then
    would overstate MFU. fp8 is counted against the same 16-bit peak: its
    float8 matmuls are a speed-up of a bf16 job, which MFU then shows.
    """
    sheet = data_sheet(device_name)
    if sheet is None:
        return None
    if precision in ("bf16", "fp16", "fp8"):
        sixteen = "bf16" if precision == "fp8" else precision
        return sheet.get(sixteen, sheet.get("fp16"))
    return sheet["tf32"] if tf32 and "tf32" in sheet else sheet["fp32"]


def tf32_in_use(convolutions: bool) -> bool:
    """Whether fp32 work that bounds the step runs as TF32 under torch's current settings.

    Matmuls use TF32 only when asked (``set_float32_matmul_precision("high")``,
    ``allow_tf32`` or the ``fp32_precision`` API); cuDNN convolutions do by
    default. Reads the newer ``fp32_precision`` attributes when torch has them,
    because mixing them with the old flags makes reading the old ones raise.
    """
    matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if matmul is None:  # torch before the fp32_precision API
        matmul = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    if matmul == "tf32":
        return True
    if not convolutions:
        return False
    conv = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    if conv is None:
        conv = "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"
    return bool(conv == "tf32" and torch.backends.cudnn.enabled)


def has_convolutions(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a 2-D (or 3-D) convolution, i.e. runs on cuDNN."""
    return any(isinstance(m, torch.nn.Conv2d | torch.nn.Conv3d) for m in model.modules())


def step_flops(workload: Workload, batch: int, device: torch.device) -> int:
    """FLOPs of one forward + backward of ``workload`` on ``batch`` samples.

    Counted on a copy of the model on the ``meta`` device: shapes only, so it
    costs no memory or time even for GPT-2 on a GPU, and attention is counted
    as its matmuls (torch's fused attention kernels are not all known to the
    counter). A model that cannot run on ``meta`` is counted on ``device``,
    still on a throw-away copy so the benchmarked one keeps its state (and DDP
    never sees an extra backward on one rank only).
    """
    try:
        return _count(workload, batch, torch.device("meta"))
    except Exception:  # a model with data-dependent Python (e.g. .item()) needs real tensors
        return _count(workload, batch, device)


def _count(workload: Workload, batch: int, device: torch.device) -> int:
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
