"""Save a (sharded) model's weights as safetensors without gathering it whole."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from manygpu.comm.common import DEFAULT_TIMEOUT_S
from manygpu.comm.objects import all_gather_json
from manygpu.errors import UsageError
from manygpu.weights import sharded_files
from manygpu.weights.load import agree
from manygpu.weights.names import model_tensors, state_names
from manygpu.weights.shards import gathered
from manygpu.weights.st_file import NAMES, Spec

SavedWeights = sharded_files.SavedWeights


def saved_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """The names a save writes, each tensor once: of tied names, the one Hugging Face keeps
    (:func:`tie_table` lists the others)."""
    dropped = tie_table(model)
    return {n: t for n, t in model_tensors(model).items() if n not in dropped}


def tie_table(model: nn.Module) -> dict[str, str]:
    """Each tied name a save drops, and the name it keeps in its place.

    ``transformers`` drops the names its ``_tied_weights_keys`` lists (a list of
    names or patterns, or a ``{tied: source}`` table) and re-ties them in
    ``from_pretrained``; otherwise the first name in state-dict order is kept.
    The table goes into the file's metadata, as ``safetensors.torch.save_model``
    records the names it drops, so a reader sees where each one went.
    """
    tied = [k for k in getattr(model, "_tied_weights_keys", None) or [] if isinstance(k, str)]
    out = {}
    for names in state_names(model):
        kept = [n for n in names if not any(n == k or _search(k, n) for k in tied)]
        name = (kept or list(names))[0]
        out.update({n: name for n in names if n != name})
    return out


def _search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def save_weights(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int = sharded_files.DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SavedWeights:
    """Write ``model``'s weights as safetensors; every rank calls it, rank 0 writes.

    ``path`` ending in ``.safetensors`` gets one file; any other path is a
    directory laid out as Hugging Face does (:mod:`.sharded_files`): loadable by
    :func:`~manygpu.weights.load_weights` and, for a ``transformers`` model whose
    ``config.json`` is beside it, by ``from_pretrained``. Sharded tensors are
    gathered one at a time (a collective per DTensor, in state-dict order), so no
    rank ever holds more of the model than its own part and one tensor. Tied
    weights are written once, the dropped names recorded in the metadata
    (:func:`tie_table`). ``dtype`` casts floating tensors.

    Raises:
        UsageError: a pipeline stage (ranks holding different tensors), or a bad
            ``max_shard_bytes``.
        CheckpointError: the write failed (the same line on every rank).
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise UsageError(f"max_shard_bytes={max_shard_bytes!r}; give a size in bytes, >= 1")
    tensors, aliases = saved_names(model), tie_table(model)
    specs = {name: Spec(tuple(t.shape), _cast_type(t.dtype, dtype)) for name, t in tensors.items()}
    _same_everywhere(specs, timeout_s)

    def values(names: list[str]) -> Iterator[torch.Tensor]:
        for name in names:
            yield gathered(tensors[name]).to(specs[name].dtype)

    main = not dist.is_initialized() or dist.get_rank() == 0
    written, error = sharded_files.write(
        Path(path), specs, values, main=main, max_shard_bytes=max_shard_bytes, metadata=aliases
    )
    agree(error, "save_weights", timeout_s)
    return written


def _cast_type(have: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    if want is None or not have.is_floating_point:
        return have
    if want not in NAMES:
        raise UsageError(f"dtype={want} cannot be stored in safetensors; give a float type")
    return want


def _same_everywhere(specs: dict[str, Spec], timeout_s: float) -> None:
    """Refuse ranks that hold different tensors (pipeline stages): their gathers would
    not pair up, and no rank could write the whole model."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    table = [(name, list(s.shape), str(s.dtype)) for name, s in specs.items()]
    mine = hashlib.sha256(json.dumps(table).encode()).hexdigest()
    every = all_gather_json(mine, operation="save_weights", timeout_s=timeout_s)
    if len(set(every)) > 1:
        raise UsageError(
            "save_weights needs every rank to hold the same tensors, and these ranks hold "
            "different ones (pipeline stages?); save a checkpoint (Checkpointer) and run "
            "manygpu checkpoint export on it instead"
        )
