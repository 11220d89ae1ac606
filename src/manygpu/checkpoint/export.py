"""Look inside a checkpoint, and export its weights as safetensors for inference."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from manygpu.checkpoint_io import formats, layout
from manygpu.checkpoint_io.layout import locate
from manygpu.errors import CheckpointError
from manygpu.weights.sharded_files import DEFAULT_MAX_SHARD_BYTES


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
    path: Path,
    out: Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Write the model weights of the checkpoint at ``path`` to ``out``; returns a summary.

    ``out`` ending in ``.safetensors`` gets one file, whatever its size; any other
    (new) path becomes a directory laid out as Hugging Face does: one
    ``model.safetensors``, or above ``max_shard_bytes`` numbered files and an
    index (:mod:`manygpu.weights.sharded_files`). Tensors stream one file's worth
    at a time (a ``full`` checkpoint is mapped, a DCP one read file by file);
    tied weights (one storage under two names) are written once, the first name.
    ``step`` picks a checkpoint under a root (default: the newest good one);
    ``dtype`` (a key of :data:`DTYPES`) casts every floating tensor.
    """
    from manygpu.weights import sharded_files
    from manygpu.weights.sources import open_checkpoint
    from manygpu.weights.st_file import Spec

    step_path = locate(path, step)
    layout.verify(step_path)
    if out.is_dir():
        raise CheckpointError(
            f"{out} is a directory that exists; give a new path: a directory (written as "
            "Hugging Face lays weights out) or a .safetensors file"
        )
    cast = DTYPES[dtype] if dtype is not None else None
    source = open_checkpoint(step_path)
    try:
        names = source.distinct()
        specs = {n: Spec(source.entries[n].shape, _cast_type(source.entries[n].dtype, cast))
                 for n in names}  # fmt: skip

        def tensors(group: list[str]) -> Iterator[torch.Tensor]:
            for tensor in source.whole(group):
                yield _cast(tensor, cast)

        written, error = sharded_files.write(
            out, specs, tensors, max_shard_bytes=max_shard_bytes,
            metadata={"source": str(step_path)},
        )  # fmt: skip
    finally:
        source.close()
    if error is not None:
        raise CheckpointError(error)
    files = [out] if out.suffix == ".safetensors" else [out / f for f in written.files]
    return {
        "checkpoint": str(step_path),
        "tensors": len(specs),
        "parameters": sum(math.prod(s.shape) for s in specs.values()),
        "dtypes": sorted({str(s.dtype).removeprefix("torch.") for s in specs.values()}),
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
    }


def _cast_type(have: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    return want if want is not None and have.is_floating_point else have


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


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
