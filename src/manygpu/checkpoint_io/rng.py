"""Every RNG a training step can draw from, per rank: python, numpy, torch, CUDA.

Stored as tensors and plain lists so the file loads with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's RNG states."""
    np_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": [list(random.getstate()[1]), random.getstate()[0], random.getstate()[2]],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # Only this process's GPU: the visible set may differ on resume (srun vs launch).
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what :func:`capture` took."""
    internal, version, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npk = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            npk["keys"].numpy().astype(np.uint32),
            npk["pos"],
            npk["has_gauss"],
            npk["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
