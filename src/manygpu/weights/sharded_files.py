"""Weights written as Hugging Face lays them out, one tensor at a time.

Below ``max_shard_bytes`` a directory gets one ``model.safetensors``; above it
``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), filled
greedily in the tensors' order as ``transformers`` does. A path ending in
``.safetensors`` gets that one file, whatever its size.

Every file is written under a temporary name, fsynced and renamed; a new
directory is built whole under a temporary name and renamed into place. Into an
existing directory (next to a ``config.json``, say) each file lands atomically,
a stale index first removed and the index written last, and weight files of an
earlier save that the new one does not use are removed at the end.

The tensors come from a callback, file by file, so the caller decides what is in
memory: :func:`manygpu.weights.save_weights` gathers one tensor at a time (every
rank calls the callback: gathering is collective; only the main rank writes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from manygpu.checkpoint_io.layout import fsync_path
from manygpu.weights.sources import INDEX, SINGLE
from manygpu.weights.st_file import Spec, StreamingFile

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""``transformers``' default shard size (5 GB): files that upload and download well."""

Tensors = Callable[[list[str]], Iterator[torch.Tensor]]
"""Given one file's tensor names, yields their values in that order."""


@dataclass(frozen=True)
class SavedWeights:
    """What a save wrote (every rank gets the same)."""

    path: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    """The tensors' bytes (the index's ``total_size``)."""


def plan(
    specs: Mapping[str, Spec], max_shard_bytes: int, *, one_file: bool
) -> dict[str, list[str]]:
    """``file name -> tensor names``: greedy in order, a new file when the next tensor
    would take this one past ``max_shard_bytes`` (a bigger tensor gets a file alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        if not one_file and groups[-1] and size + spec.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += spec.nbytes
    if len(groups) == 1:
        return {SINGLE: groups[0]}
    n = len(groups)
    return {f"model-{i:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups, start=1)}


def write(
    path: Path,
    specs: Mapping[str, Spec],
    tensors: Tensors,
    *,
    main: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> tuple[SavedWeights, str | None]:
    """Write ``specs``' tensors to ``path``; every rank calls it (``tensors`` may be
    collective), the ``main`` one writes. Returns what was written and, instead of
    raising, the main rank's error: it keeps calling ``tensors`` to the end so that
    no other rank waits in a collective it left."""
    one_file = path.suffix == ".safetensors"
    files = plan(specs, max_shard_bytes, one_file=one_file)
    names = list(files) if not one_file else [path.name]
    total = sum(s.nbytes for s in specs.values())
    written = SavedWeights(str(path), tuple(names), len(specs), total)
    error: str | None = None
    target = None
    if main:
        try:
            target = _Target(path, one_file)
        except OSError as exc:
            error = _why(path, exc)
    try:
        for group, name in zip(files.values(), names, strict=True):
            out = None
            if target is not None and error is None:
                try:
                    own = {n: specs[n] for n in group}
                    out = StreamingFile(target.tmp(name), own, metadata or {})
                except OSError as exc:
                    error = _why(path, exc)
            for tensor_name, tensor in zip(group, tensors(group), strict=True):
                if out is not None and error is None:
                    try:
                        out.add(tensor_name, tensor)
                    except (OSError, ValueError) as exc:
                        error = _why(path, exc)
                del tensor  # one tensor in flight
            if out is not None:
                if error is None:
                    error = _close(out, path)
                else:
                    out.abort()
        if target is not None and error is None:
            target.commit(names, files if not one_file and len(files) > 1 else None, written.bytes)
    except OSError as exc:
        error = _why(path, exc)
    finally:
        if target is not None and error is not None:
            target.abort()
    return written, error


def _close(out: StreamingFile, path: Path) -> str | None:
    try:
        out.close()
    except (OSError, ValueError) as exc:
        return _why(path, exc)
    return None


WHY_CHARS = 400
"""How much of an error's text a failed write keeps (all of it, on one line, up to this)."""


def _why(path: Path, exc: BaseException) -> str:
    """One line for a failed write: the disk's error blames the path; any other keeps
    its whole reason (a library's message may start with an empty line)."""
    if isinstance(exc, OSError):
        why = exc.strerror or " ".join(str(exc).split()) or type(exc).__name__
        return f"cannot write {path} ({why}); give a writable path with room for the weights"
    why = " ".join(str(exc).split())[:WHY_CHARS] or type(exc).__name__
    return f"cannot write {path}: {type(exc).__name__}: {why}"


class _Target:
    """Where the files go: temporary names first, then renamed into place."""

    def __init__(self, path: Path, one_file: bool) -> None:
        self.path, self.one_file = path, one_file
        self.fresh = not path.exists()
        if path.is_dir() and one_file:
            raise IsADirectoryError(21, "it is a directory", str(path))
        if one_file:
            self.where = path.parent
        elif self.fresh:
            self.where = path.with_name(f".{path.name}.tmp")
            shutil.rmtree(self.where, ignore_errors=True)
        else:
            self.where = path
            with contextlib.suppress(FileNotFoundError):
                (path / INDEX).unlink()  # a stale index must not point at the new files
        self.where.mkdir(parents=True, exist_ok=True)
        self.made: list[Path] = []

    def tmp(self, name: str) -> Path:
        tmp = self.where / (f".{name}.tmp" if not self.fresh or self.one_file else name)
        self.made.append(tmp)
        return tmp

    def commit(self, names: list[str], index: Mapping[str, list[str]] | None, total: int) -> None:
        if index is not None:
            table = {"metadata": {"total_size": total},
                     "weight_map": {t: f for f, group in index.items() for t in group}}  # fmt: skip
            tmp = self.tmp(INDEX)
            tmp.write_text(json.dumps(table, indent=2) + "\n")
            fsync_path(tmp)
            names = [*names, INDEX]
        if self.one_file or not self.fresh:
            for tmp, name in zip(self.made, names, strict=True):
                os.replace(tmp, self.where / name)
            if not self.one_file:
                self._remove_stale(set(names))
        else:
            fsync_path(self.where)
            os.replace(self.where, self.path)
        fsync_path(self.path.parent if self.one_file or self.fresh else self.path)
        self.made = []

    def _remove_stale(self, keep: set[str]) -> None:
        for old in self.path.glob("model*.safetensors"):
            if old.name not in keep and (old.name == SINGLE or old.name.startswith("model-")):
                old.unlink()

    def abort(self) -> None:
        for tmp in self.made:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if self.fresh and not self.one_file:
            shutil.rmtree(self.where, ignore_errors=True)
