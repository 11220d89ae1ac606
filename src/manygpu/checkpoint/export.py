"""Look inside a checkpoint, and export its weights as safetensors for inference."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from manygpu.checkpoint_io import formats, layout
from manygpu.errors import CheckpointError


def locate(path: Path) -> Path:
    """A step directory, or the newest good one under a checkpoint root."""
    if (path / layout.META).is_file():
        return path
    for candidate in reversed(layout.committed(path)):
        try:
            return layout.verify(candidate).path
        except CheckpointError:
            continue
    raise CheckpointError(f"no complete checkpoint in {path}")


def model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model's full (consolidated) state dict, on CPU, from either format."""
    if formats.detect(path) == "full":
        state = formats.load_file(path / formats.MODEL)
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint file {path / formats.MODEL} holds no state dict")
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    from manygpu.checkpoint_io.safe_dcp import safe_load

    full: dict[str, Any] = {}
    safe_load(full, path, whole=True, no_dist=True)
    return {k: v for k, v in full.get("model", {}).items() if isinstance(v, torch.Tensor)}


def export_safetensors(path: Path, out: Path) -> dict[str, Any]:
    """Write the model weights of the checkpoint at ``path`` to ``out``; returns a summary."""
    from safetensors.torch import save_file

    step_path = locate(path)
    layout.verify(step_path)
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory; give the path of a .safetensors file")
    state = {k: v.contiguous() for k, v in model_state(step_path).items()}
    tmp = out.with_suffix(out.suffix + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp), metadata={"source": str(step_path)})
        tmp.replace(out)
    except Exception as exc:  # OSError, or safetensors' own error for the same I/O
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:200]
        raise CheckpointError(f"cannot write {out} ({why}); give a writable path") from None
    return {
        "checkpoint": str(step_path),
        "tensors": len(state),
        "parameters": sum(v.numel() for v in state.values()),
        "bytes": out.stat().st_size,
    }


def inspect(path: Path, *, hashes: bool = True) -> dict[str, Any]:
    """What a checkpoint holds, and whether it verifies."""
    step_path = locate(path)
    meta = layout.read_meta(step_path)
    try:
        layout.verify(step_path, hashes=hashes)
        status = "ok"
    except CheckpointError as exc:
        status = str(exc)
    state = model_state(step_path) if status == "ok" else {}
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in state.values()})
    return {
        "path": str(step_path),
        "status": status,
        "step": meta.get("step"),
        "epoch": meta.get("epoch"),
        "format": formats.detect(step_path),
        "world_size": meta.get("world_size"),
        "strategy": meta.get("strategy"),
        "precision": meta.get("precision"),
        "created": meta.get("created"),
        "loader": meta.get("loader"),
        "extra": meta.get("extra"),
        "files": {k: v["bytes"] for k, v in meta.get("files", {}).items()},
        "bytes": sum(v["bytes"] for v in meta.get("files", {}).values()),
        "model_tensors": len(state),
        "model_parameters": sum(v.numel() for v in state.values()),
        "dtypes": dtypes,
    }
