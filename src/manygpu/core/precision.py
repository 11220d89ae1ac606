"""Mixed precision: what ``precision=`` resolves to, autocast, the fp16 grad scaler, TF32.

``precision="auto"`` (the default) is decided per device by
:func:`resolve_precision`, a pure function of the request and the device's
facts, so every branch is testable without the hardware:

- CPU (and devices we know nothing of): fp32, exactly as before;
- CUDA with native bf16 (compute capability >= 8.0: A100, H100, RTX 30xx+):
  bf16 autocast, weights and optimizer state stay fp32;
- older CUDA GPUs (V100, T4): fp16 autocast with a grad scaler (bf16 is only
  emulated there, and slower than fp32).

On CUDA, matmuls and convolutions left in fp32 use TF32 tensor cores
unless the user asked for ``"fp32-strict"``. What strategies, checkpoints and
the planner see is the resolved ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"``.

``"fp8"`` is opt-in only (``"auto"`` never picks it; :mod:`manygpu.transforms.fp8`
says why): float8 matmuls from torchao inside bf16 autocast, refused in one
line on devices without FP8 tensor cores.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from manygpu.transforms.fp8 import Fp8Training, check_fp8_device, require_torchao

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_AUTOCAST = {**_DTYPES, "fp8": torch.bfloat16}  # fp8: float8 linears, bf16 around them

Resolved = Literal["fp32", "bf16", "fp16", "fp8"]
BF16_CAPABILITY = (8, 0)
"""The first CUDA compute capability with bf16 (and TF32) tensor cores (Ampere)."""
STRICT = "fp32-strict"


@dataclass(frozen=True, kw_only=True)
class PrecisionChoice:
    """What a ``precision=`` request became on one device."""

    requested: str
    """What the user asked for (``"auto"``, ``"fp32"``, ``"fp32-strict"``, ...)."""
    precision: Resolved
    """What autocast, the scaler, strategies and checkpoints use."""
    device_type: str
    """``"cuda"``, ``"cpu"``, ...: TF32 flags are set on CUDA only."""
    tf32: bool
    """Whether fp32 matmuls/convolutions may use TF32 (CUDA only; ``False`` with
    ``"fp32-strict"``)."""
    capability: tuple[int, int] | None = None
    """The CUDA compute capability it was decided for (``None`` off CUDA)."""
    fp8_emulated: bool = False
    """``"fp8"`` through torchao's emulation (``MANYGPU_FP8_EMULATE=1``: tests only)."""


def resolve_precision(
    requested: str,
    *,
    device_type: str,
    capability: tuple[int, int] | None = None,
    refused: Collection[str] = (),
    fp8_emulate: bool = False,
) -> PrecisionChoice:
    """The precision a job runs in: pure, so tests can pass any device's facts.

    Args:
        requested: the config's ``precision``.
        device_type: ``torch.device.type`` of this process's device.
        capability: CUDA compute capability (``None``: unknown or not CUDA).
        refused: precisions the strategy cannot train in; ``"auto"`` avoids them
            (an explicit request is left for the strategy to refuse by name).
        fp8_emulate: ``MANYGPU_FP8_EMULATE=1``: run ``"fp8"`` through torchao's
            emulation on any device (tests only); otherwise fp8 needs FP8 tensor cores.
    """
    cuda = device_type == "cuda"
    if requested == "auto":
        precision: Resolved = "fp32"
        if cuda and capability is not None:
            precision = "bf16" if capability >= BF16_CAPABILITY else "fp16"
        if precision in refused:
            precision = "fp32"
    elif requested in ("fp32", STRICT):
        precision = "fp32"
    elif requested in _DTYPES:
        precision = "bf16" if requested == "bf16" else "fp16"
    elif requested == "fp8":
        check_fp8_device(device_type, capability, emulate=fp8_emulate)
        require_torchao()  # a missing extra is said before any process group exists
        precision = "fp8"
    else:
        raise ValueError(f"unknown precision {requested!r}")
    return PrecisionChoice(
        requested=requested,
        precision=precision,
        device_type=device_type,
        tf32=cuda and requested != STRICT,
        capability=capability if cuda else None,
        fp8_emulated=precision == "fp8" and fp8_emulate,
    )


def announcement(choice: PrecisionChoice, device_name: str) -> str | None:
    """The one line the main rank prints about what was chosen for the user, or ``None``.

    Said when manygpu decided something the user did not spell out: what
    ``"auto"`` picked on a GPU, or TF32 for an explicit ``"fp32"``. The CPU's
    fp32 is what the user would get anyway: nothing to say.
    """
    if choice.device_type != "cuda":
        return None
    tf32 = choice.tf32 and choice.capability is not None and choice.capability >= BF16_CAPABILITY
    if choice.requested == "auto":
        picked = {
            "bf16": "bf16 autocast (fp32 weights)",
            "fp16": "fp16 autocast with loss scaling (fp32 weights; no bf16 before "
            "compute capability 8.0)",
            "fp32": "fp32",
        }[choice.precision]
        extra = ", fp32 matmuls in TF32" if tf32 else ""
        return (
            f"manygpu: precision='auto' chose {picked}{extra} on {device_name}; "
            f"precision='fp32' to turn it off ('{STRICT}' also turns off TF32)"
        )
    if choice.requested == "fp32" and tf32:
        return (
            f"manygpu: precision='fp32' runs fp32 matmuls and convolutions in TF32 on "
            f"{device_name}; precision='{STRICT}' to turn it off"
        )
    return None


def cuda_facts(device: torch.device) -> tuple[tuple[int, int] | None, str]:
    """``(compute capability, name)`` of a CUDA device; ``(None, type)`` for others."""
    if device.type != "cuda":
        return None, device.type
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor), torch.cuda.get_device_name(device)


def apply_tf32(choice: PrecisionChoice) -> Callable[[], None]:
    """Set torch's TF32 switches for a CUDA job; returns what restores them.

    The legacy ``allow_tf32`` switches are used on purpose: torch reads them
    back through either API, whereas after its newer ``fp32_precision``
    setters a read of ``allow_tf32`` (in user code or a library) raises.
    Off CUDA nothing is touched (and nothing is restored).
    """
    if choice.device_type != "cuda":
        return lambda: None
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        before = (bool(matmul.allow_tf32), bool(cudnn.allow_tf32))
    except RuntimeError:  # the user mixed torch's two TF32 APIs: cannot read back
        before = None
    matmul.allow_tf32 = choice.tf32
    cudnn.allow_tf32 = choice.tf32

    def restore() -> None:
        if before is not None:
            matmul.allow_tf32, cudnn.allow_tf32 = before

    return restore


def outputs_to_fp32(out: Any, low: torch.dtype) -> Any:
    """``out`` with every tensor of dtype ``low`` cast to fp32, structure kept (tuples,
    dicts, named tuples, HF ``ModelOutput``: pytree nodes); other tensors untouched."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype == low else t

    return pytree.tree_map_only(torch.Tensor, cast, out)


class PrecisionPlugin:
    """Owns the autocast dtype and, for fp16, the loss scaler."""

    def __init__(self, precision: str, device: torch.device, *, fp8_emulate: bool = False) -> None:
        self.precision = precision
        self.device = device
        self.dtype = _AUTOCAST.get(precision)
        self.fp8 = Fp8Training(emulate=fp8_emulate) if precision == "fp8" else None
        """For ``"fp8"``: converts prepared models to torchao's float8 linears."""
        # fp16's narrow exponent underflows small gradients; bf16 has fp32's
        # range and needs no scaling.
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self._update_pending = False

    @classmethod
    def chosen(cls, choice: PrecisionChoice, device: torch.device) -> PrecisionPlugin:
        """The plugin for what ``precision=`` resolved to on ``device``."""
        return cls(choice.precision, device, fp8_emulate=choice.fp8_emulated)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the enclosed ops in the chosen low precision (no-op for fp32)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield

    def wrap_forward(self, module: torch.nn.Module) -> None:
        """Make ``module(...)`` run under autocast without the user writing it.

        Patched on the instance (like Accelerate) so state-dict keys stay the same.
        Outputs in the autocast dtype come back as fp32: the user's loss runs
        outside autocast, where ``mse_loss(bf16_out, fp32_target)`` fails on CUDA
        in backward and a bf16 ``cross_entropy`` loses precision; autocast itself
        computes those losses in fp32 (Accelerate casts outputs the same way).
        """
        if self.dtype is None:
            return
        forward: Callable[..., Any] = module.forward
        low = self.dtype

        @functools.wraps(forward)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with self.autocast():
                out = forward(*args, **kwargs)
            return outputs_to_fp32(out, low)

        module.forward = autocast_forward

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss
        if self._update_pending:
            # Once per cycle, after every optimizer stepped (GANs have several):
            # update() resets all optimizers' unscale state.
            self.scaler.update()
            self._update_pending = False
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to true scale (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step; with a scaler, skipped on inf/nan and the scale updated."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self._update_pending = True
