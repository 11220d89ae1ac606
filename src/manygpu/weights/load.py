"""Load weights from files straight into a (sharded) model's own tensors."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from manygpu.checkpoint_io.remote import Url
from manygpu.comm.common import DEFAULT_TIMEOUT_S
from manygpu.comm.objects import all_gather_json
from manygpu.errors import CheckpointError
from manygpu.weights.experts import stack_experts
from manygpu.weights.names import Expected, match, model_tensors
from manygpu.weights.sources import SlicedSource, Source, open_source
from manygpu.weights.url_sources import open_url_source, resolve


@dataclass(frozen=True)
class LoadReport:
    """What one rank's load did."""

    source: str
    """What was read: the file, directory, or the checkpoint step chosen under a root."""
    tensors: int
    """Tensors of this rank's model that were filled (tied names count once)."""
    bytes_read: int
    """Bytes this rank read: its own blocks of sharded tensors, replicated ones whole."""


def load_weights(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    expected: Expected | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> LoadReport:
    """Fill ``model``'s parameters and persistent buffers from the weights at ``path``.

    ``model`` is the user's module, already sharded or wrapped by a strategy:
    plain tensors, or DTensors (FSDP2, HSDP, tensor parallel, both), each rank's
    part in place, cast to the tensor's dtype, on its device (host memory too,
    with CPU offload). Each rank reads only the blocks it owns. ``path`` is a
    ``.safetensors`` file, a Hugging Face-style directory or a manygpu checkpoint
    (:mod:`.sources`), on disk or at an fsspec URL such as ``s3://bucket/model``
    (:mod:`.url_sources`); names match as ``load_state_dict``'s do (:mod:`.names`).

    Args:
        expected: the whole model's state-dict names (tied names grouped,
            :func:`~manygpu.weights.state_names`) when ``model`` is one pipeline
            stage of it; default: ``model``'s own.
        storage_options: for a URL, passed to fsspec as given (as the
            checkpointer's are), e.g. ``{"profile": "training"}`` for S3.
        timeout_s: how long a rank waits for the others to agree that every
            rank's check and read succeeded (two small all-gathers when a
            process group is up, so a failure on one rank is raised on all).

    Raises:
        UsageError: a URL whose fsspec backend is not installed (naming the
            extra to install), or ``storage_options`` with a local path.
        CheckpointError: one line, the same on every rank: a path that does not
            exist, refused credentials, a pickle, keys missing or unexpected, a
            shape that differs, a read that failed (the first failing rank's reason).
    """
    where = resolve(path, storage_options)
    source: Source | None = None
    try:
        try:
            source = open_url_source(where) if isinstance(where, Url) else open_source(where)
            if isinstance(source, SlicedSource):  # experts stored apart, a model that stacks
                source = stack_experts(source, _names(model, expected))
            pairs = match(model, source.entries, source.where, expected)
        except CheckpointError as exc:
            agree(str(exc), "load_weights", timeout_s)
            raise
        # Every rank fits before any rank reads (DCP's reads are collective).
        agree(None, "load_weights", timeout_s)
        try:
            read = source.fill(pairs)
        except Exception as exc:  # I/O, a damaged file, a device error
            error = str(exc) if isinstance(exc, CheckpointError) else _failed(source, exc)
            agree(error, "load_weights", timeout_s)
            raise CheckpointError(error) from None
        agree(None, "load_weights", timeout_s)
        return LoadReport(source=source.where, tensors=len(pairs), bytes_read=read)
    finally:
        if source is not None:
            source.close()


def _names(model: nn.Module, expected: Expected | None) -> list[str]:
    """Every state-dict name the load fills: the model's own, and a whole model's."""
    names = list(model_tensors(model))
    for item in expected or ():
        names += [item] if isinstance(item, str) else list(item)
    return names


def _failed(source: Source, exc: BaseException) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = (lines or [type(exc).__name__])[0][:240]
    return f"reading weights {source.where} failed on rank {rank} ({why}); check the files"


def agree(error: str | None, operation: str, timeout_s: float) -> None:
    """Raise the first failing rank's error on every rank, or return when none failed
    (collective when a process group of more than one rank is up)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise CheckpointError(error)
        return
    every = all_gather_json(error, operation=operation, timeout_s=timeout_s)
    first = next((e for e in every if e is not None), None)
    if first is not None:
        raise CheckpointError(str(first))
