"""Knobs every strategy shares: how ``compile=`` calls ``torch.compile``.

Each strategy's own knobs live on its object (``DDP(bucket_cap_mb=50)``, in its package).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.nn import Module

from manygpu.errors import UsageError

# torch.compile's modes (``None``: its default); named here so a typo fails at construction.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How ``Parallel(compile=...)`` calls ``torch.compile`` on the prepared model.

    Each strategy decides *where* it is applied (after DDP wrapping, per FSDP2
    block, per pipeline stage); these are the knobs torch itself takes.
    """

    mode: str | None = None
    """``"default"``, ``"reduce-overhead"`` (CUDA graphs), ``"max-autotune"`` or
    ``"max-autotune-no-cudagraphs"``; ``None`` is torch's default."""
    fullgraph: bool = False
    """Fail on a graph break instead of falling back to eager for that part."""
    dynamic: bool | None = None
    """Compile for dynamic shapes up front (``True``), never (``False``), or when a
    shape changes (``None``, torch's default)."""

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise UsageError(
                f"unknown compile mode {self.mode!r}; choose one of {', '.join(COMPILE_MODES)} "
                "or None"
            )
        if not isinstance(self.fullgraph, bool):
            raise UsageError(
                f"CompileOptions(fullgraph=...) takes True or False, not {self.fullgraph!r}"
            )
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise UsageError(
                f"CompileOptions(dynamic=...) takes True, False or None, not {self.dynamic!r}"
            )

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile`` / ``nn.Module.compile``."""
        return {"mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic}


def compile_in_place(module: Module, options: CompileOptions) -> None:
    """Compile ``module`` in place (``nn.Module.compile``).

    In place rather than ``torch.compile(module)``: the module object, its
    ``state_dict`` keys (no ``_orig_mod.`` prefix) and the hooks strategies put
    on it stay as they are, so checkpoints and ``unwrap`` do not change.
    """
    module.compile(**options.kwargs())
