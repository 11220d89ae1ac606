"""Look inside a checkpoint, and export its weights as safetensors for inference.

A checkpoint at a URL (``s3://bucket/prefix``) is found there
(:func:`~manygpu.checkpoint_io.remote_layout.locate`), downloaded into a
temporary directory, verified, and read as a local one (:func:`located`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from manygpu.checkpoint_io import formats, layout, remote, remote_layout, store
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


@contextmanager
def located(path: Path | str, step: int | None = None) -> Iterator[tuple[Path, str]]:
    """The checkpoint ``path`` names (``step``'s, or the newest good one) as a local
    directory, and the name to show for it (a URL's step is downloaded and verified)."""
    if not remote.is_url(path):
        found = locate(Path(path), step)
        yield found, str(found)
        return
    chosen = remote_layout.locate(remote.connect(str(path)), step)
    with store.UrlStore(chosen).local_copy(chosen) as local:
        yield local, str(chosen)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""What ``export --dtype`` casts floating tensors to (integer tensors keep their type)."""


def export_safetensors(
    path: Path | str,
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
    at a time (a ``full`` checkpoint is mapped, a DCP one read file by file).
    Tied weights (one tensor under two names, as the checkpoint recorded them, or
    one storage in an older ``full`` one) are written once under the name
    Hugging Face keeps; each dropped name is recorded in the files' metadata as
    ``{dropped: kept}``, as ``safetensors.torch.save_model`` does, and
    ``transformers`` and :func:`~manygpu.weights.load_weights` re-tie it on load.
    ``step`` picks a checkpoint under a root (default: the newest good one);
    ``dtype`` (a key of :data:`DTYPES`) casts every floating tensor.
    """
    if out.is_dir():
        raise CheckpointError(
            f"{out} is a directory that exists; give a new path: a directory (written as "
            "Hugging Face lays weights out) or a .safetensors file"
        )
    cast = DTYPES[dtype] if dtype is not None else None
    with located(path, step) as (step_path, shown):
        layout.verify(step_path)
        summary = _export(step_path, shown, out, cast, max_shard_bytes)
    return summary


def _export(
    step_path: Path, shown: str, out: Path, cast: torch.dtype | None, max_shard_bytes: int
) -> dict[str, Any]:
    """:func:`export_safetensors` of the local checkpoint ``step_path`` (shown as ``shown``)."""
    from manygpu.weights import sharded_files
    from manygpu.weights.sources import open_checkpoint
    from manygpu.weights.st_file import Spec

    source = open_checkpoint(step_path)
    try:
        aliases = source.aliases()
        names = source.distinct()
        specs = {n: Spec(source.entries[n].shape, _cast_type(source.entries[n].dtype, cast))
                 for n in names}  # fmt: skip

        def tensors(group: list[str]) -> Iterator[torch.Tensor]:
            for tensor in source.whole(group):
                yield _cast(tensor, cast)

        written, error = sharded_files.write(
            out, specs, tensors, max_shard_bytes=max_shard_bytes,
            metadata={**aliases, "source": shown},
        )  # fmt: skip
    finally:
        source.close()
    if error is not None:
        raise CheckpointError(error)
    files = [out] if out.suffix == ".safetensors" else [out / f for f in written.files]
    return {
        "checkpoint": shown,
        "tensors": len(specs),
        "parameters": sum(math.prod(s.shape) for s in specs.values()),
        "dtypes": sorted({str(s.dtype).removeprefix("torch.") for s in specs.values()}),
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "tied": aliases,
    }


def _cast_type(have: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    return want if want is not None and have.is_floating_point else have


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


def inspect(path: Path | str, *, hashes: bool = True) -> dict[str, Any]:
    """What a checkpoint holds, and whether it verifies (one at a URL: downloaded first)."""
    if remote.is_url(path):
        return _inspect_url(str(path))
    return _inspect(locate(Path(path)), hashes=hashes)


def _inspect_url(url: str) -> dict[str, Any]:
    """:func:`inspect` of a step at a URL: a damaged one is reported from its ``meta.json``."""
    chosen = remote_layout.locate(remote.connect(url))
    try:
        with store.UrlStore(chosen).local_copy(chosen) as local:
            return _inspect(local) | {"path": str(chosen)}
    except CheckpointError as exc:
        meta = remote_layout.read_meta(chosen)
        return _summary(str(chosen), str(exc), meta, None, {})


def _inspect(step_path: Path, *, hashes: bool = True) -> dict[str, Any]:
    meta = layout.read_meta(step_path)
    try:
        layout.verify(step_path, hashes=hashes)
        status = "ok"
    except CheckpointError as exc:
        status = str(exc)
    state = model_state(step_path) if status == "ok" else {}
    return _summary(str(step_path), status, meta, formats.detect(step_path), state)


def _summary(
    path: str, status: str, meta: dict[str, Any], fmt: str | None, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in state.values()})
    return {
        "path": path,
        "status": status,
        "step": meta.get("step"),
        "epoch": meta.get("epoch"),
        "sample": sample_of(meta),
        "format": fmt,
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
