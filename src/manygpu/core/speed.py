"""The speed-ups ``Parallel`` applies on its own to the step: fused optimizer steps, compile.

channels_last, a change of the model, is a model transform
(:mod:`manygpu.transforms.channels_last`).

Each decision is a pure function of facts passed in (optimizer type and
settings, device types, the model's layers), so the CUDA-only paths are
tested on the CPU; the functions that act on them are separate and small.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection
from typing import Any

import torch

from manygpu.errors import UsageError

# Optimizers whose fused kernels do the same math as their per-parameter and
# foreach paths (torch tests them against each other). Exact types: a
# subclass may override step() and ignore the "fused" group flag.
FUSABLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)


def param_device_types(optimizer: torch.optim.Optimizer) -> set[str]:
    """The device types (``"cuda"``, ``"cpu"``) of every parameter ``optimizer`` holds."""
    return {p.device.type for group in optimizer.param_groups for p in group["params"]}


def fused_step_applies(optimizer: torch.optim.Optimizer, device_types: Collection[str]) -> bool:
    """Whether to switch ``optimizer`` to its fused step (a pure decision).

    Only for torch's Adam, AdamW and SGD whose parameters are all on CUDA
    (``device_types == {"cuda"}``), when the user chose neither ``foreach`` nor
    ``fused`` (the constructor records ``None`` for both then, in the defaults
    and in every group), the optimizer has not stepped yet (its state would be
    laid out for the unfused path) and every parameter is a real floating tensor.
    """
    if type(optimizer) not in FUSABLE or set(device_types) != {"cuda"}:
        return False
    if optimizer.state or optimizer.defaults.get("differentiable"):
        return False
    groups: list[dict[str, Any]] = [optimizer.defaults, *optimizer.param_groups]
    if any(g.get("fused") is not None or g.get("foreach") is not None for g in groups):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return all(p.is_floating_point() and not p.is_sparse for p in params)


def use_fused_step(optimizer: torch.optim.Optimizer) -> None:
    """Switch a fresh Adam/AdamW/SGD to its fused step, as ``fused=True`` would have.

    Mutated in place, not rebuilt: schedulers and the user's references stay
    bound to this object. The defaults change too, so groups added later and
    optimizers rebuilt from them (ZeRO-1) are fused as well; the two flags the
    constructor sets for ``fused=True`` are set the same way.
    """
    for group in [optimizer.defaults, *optimizer.param_groups]:
        group["fused"] = True
    # GradScaler hands its scale and inf flag to the fused kernel instead of
    # unscaling in a separate pass; the kernel checks device and dtype once.
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    optimizer._need_device_dtype_check_for_fused = True  # type: ignore[attr-defined]


def check_compiler(device: torch.device) -> None:
    """Refuse ``compile=True`` on a CPU without a C++ compiler, before a long inductor traceback.

    torch's inductor writes C++ for CPU kernels and builds it with the
    system's compiler; GPUs use Triton instead and need none.
    """
    if device.type != "cpu":
        return
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise UsageError(
            "compile=True on the CPU needs a C++ compiler for torch's inductor (g++ or "
            "clang++ on the PATH); install one or leave compile=False"
        )
