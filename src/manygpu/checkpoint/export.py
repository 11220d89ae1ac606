"""Look inside a checkpoint, and export its weights as safetensors for inference."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Any

import torch

from manygpu.checkpoint_io import formats, layout
from manygpu.checkpoint_io.layout import locate
from manygpu.errors import CheckpointError


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


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""What ``export --dtype`` casts floating tensors to (integer tensors keep their type)."""


def export_safetensors(
    path: Path, out: Path, *, step: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """Write the model weights of the checkpoint at ``path`` to ``out``; returns a summary.

    ``step`` picks a checkpoint under a root (default: the newest good one);
    ``dtype`` (a key of :data:`DTYPES`) casts every floating tensor.
    """
    from safetensors.torch import save_file

    step_path = locate(path, step)
    layout.verify(step_path)
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory; give the path of a .safetensors file")
    cast = DTYPES[dtype] if dtype is not None else None
    state = {k: _cast(v, cast).contiguous() for k, v in model_state(step_path).items()}
    tmp = out.with_suffix(out.suffix + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        mode = _new_file_mode(tmp)
        save_file(state, str(tmp), metadata={"source": str(step_path)})
        # safetensors writes its file owner-only (0600), whatever the umask
        # says; an exported model is meant to be shared like any other file.
        os.chmod(tmp, mode)
        layout.fsync_path(tmp)
        tmp.replace(out)  # atomic: a reader sees the old file or the whole new one
        layout.fsync_path(out.parent)
    except Exception as exc:  # OSError, or safetensors' own error for the same I/O
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:200]
        raise CheckpointError(f"cannot write {out} ({why}); give a writable path") from None
    return {
        "checkpoint": str(step_path),
        "tensors": len(state),
        "parameters": sum(v.numel() for v in state.values()),
        "dtypes": sorted({str(v.dtype).removeprefix("torch.") for v in state.values()}),
        "bytes": out.stat().st_size,
    }


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


def _new_file_mode(path: Path) -> int:
    """The mode a new file gets here (0666 less the umask): ``path`` is created to see it.

    Read from a file the kernel just created rather than by setting the
    umask to read it back, which would race with other threads creating files.
    """
    path.unlink(missing_ok=True)  # a leftover keeps its own mode
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


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
        "sample": sample_of(meta),
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


def sample_of(meta: dict[str, Any]) -> int | None:
    """Where in its epoch the checkpoint's loader stood (global samples read), if it had one."""
    saved = meta.get("loader")
    if not isinstance(saved, dict):
        return None
    try:
        return int(saved["batches"]) * int(saved["world"]) * int(saved["batch_size"])
    except (KeyError, TypeError, ValueError):  # not a position we wrote
        return None
