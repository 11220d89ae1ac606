"""Where weights come from: what a path holds is decided by its structure, never by trust.

- a ``.safetensors`` file (its header is checked by ``safetensors`` itself);
- a Hugging Face-style directory: ``model.safetensors``, or the files a
  ``model.safetensors.index.json`` weight map names (each a plain file name
  inside the directory);
- a manygpu checkpoint (a step directory with ``meta.json``, or the root holding
  them: the newest good one): ``full`` format mapped with ``weights_only``,
  ``dcp`` through :mod:`manygpu.checkpoint_io.safe_dcp`, which reshards by itself.

A pickle (``torch.save``'s zip or a bare pickle, whatever its suffix) is refused
before anything is read from it: unpickling runs code.

Each source says what it holds (:attr:`Source.entries`: name -> shape and dtype,
from headers only) and fills target tensors (:meth:`Source.fill`): the sliced
sources read for each DTensor exactly the block its rank owns.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from manygpu.checkpoint_io import formats, layout
from manygpu.errors import CheckpointError
from manygpu.weights import shards
from manygpu.weights.st_file import DTYPES, Spec

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive; pickle protocol 2+
_CONVERT = (
    "convert it to safetensors where you trust it, e.g. transformers' "
    "save_pretrained(DIR, safe_serialization=True), or safetensors.torch.save_file("
    "{k: v.clone() for k, v in torch.load(FILE, weights_only=True).items()}, OUT)"
)


def pickle_refusal(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} is a pickle file (torch.save); loading it could run code, so it is refused; "
        + _CONVERT
    )


class Source(ABC):
    """Weights by name, read on demand."""

    where: str
    """How errors name the source (its path)."""
    entries: dict[str, Spec]
    """Every tensor it holds: name -> global shape and dtype (no values read)."""

    @abstractmethod
    def fill(self, targets: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Copy each named stored tensor into its target (a plain tensor or a DTensor,
        in place, cast to its dtype); returns the bytes this rank read."""

    def close(self) -> None:
        """Release open files."""

    @abstractmethod
    def whole(self, names: Sequence[str]) -> Iterator[torch.Tensor]:
        """Each named tensor whole, on CPU, in order (for an export: one file's worth)."""

    tied: Mapping[str, str] = {}
    """Tied names a checkpoint recorded (``meta.json``'s ``tied``): dropped name -> kept name."""

    def aliases(self) -> dict[str, str]:
        """The tied names an export drops, each with the name it keeps instead (the
        recorded table, where both names hold the same shape and dtype)."""
        have = self.entries
        same = {a: k for a, k in self.tied.items() if k in have and have.get(a) == have[k]}
        return {a: k for a, k in same.items() if a != k}

    def distinct(self) -> list[str]:
        """The names to export, each stored tensor once (:meth:`aliases` dropped)."""
        dropped = self.aliases()
        return [n for n in self.entries if n not in dropped]


class SlicedSource(Source):
    """A source that can read any block of a tensor: each rank reads what it owns."""

    @abstractmethod
    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        """``name``'s values at ``index`` (None: all of it), on CPU, as stored."""

    def whole(self, names: Sequence[str]) -> Iterator[torch.Tensor]:
        for name in names:
            yield self.read(name, None)

    def fill(self, targets: Sequence[tuple[str, torch.Tensor]]) -> int:
        total = 0
        for name, target in targets:
            total += shards.fill_one(target, functools.partial(self.read, name))
        return total


class SafetensorsSource(SlicedSource):
    """One or more safetensors files (``files``: tensor name -> the file holding it)."""

    def __init__(self, where: str, files: Mapping[str, Path]) -> None:
        self.where, self.files = where, dict(files)
        self.handles: dict[Path, Any] = {}
        self._layouts: dict[Path, dict[str, tuple[Spec, int]]] = {}
        self.entries = {}
        for path in sorted(set(self.files.values())):
            handle = self._open(path)
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if self.files.get(name) == path:
                    piece = handle.get_slice(name)
                    self.entries[name] = Spec(tuple(piece.get_shape()), _dtype(piece, path))
        lost = sorted(set(self.files) - set(self.entries))
        if lost:
            raise CheckpointError(
                f"{where} is damaged: its index puts {lost[0]} in {self.files[lost[0]].name}, "
                f"which does not hold it ({len(lost)} such); re-save the weights"
            )

    def _open(self, path: Path) -> Any:
        from safetensors import safe_open

        handle = self.handles.get(path)
        if handle is None:
            try:
                handle = self.handles[path] = safe_open(str(path), framework="pt")
            except Exception as exc:  # SafetensorError, OSError
                raise _unreadable(path, exc) from None
        return handle

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        shape = self.entries[name].shape
        if not shape:  # a 0-d tensor has no rows
            return self._open(self.files[name]).get_tensor(name)
        rows = _row_block(shape, index)
        if rows is not None:
            return self._pread(name, *rows)
        # Columns (a row-parallel weight's share): the tensor's rows read whole, one
        # tensor in flight, and this rank's block copied out of them.
        assert index is not None
        first = index[0]
        whole = self._pread(name, first.start or 0, shape[0] if first.stop is None else first.stop)
        block = [slice(None), *index[1:]]
        return whole[tuple(block)].clone()

    def _pread(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of ``name`` read with ``pread`` into fresh memory.

        Not through safetensors' memory map: pages of a mapped file count in the
        process's resident set while it is open, so each rank's share of the file
        would show twice (mapped, then copied). One block of rows is one byte range.
        """
        path = self.files[name]
        spec, begin = self._layout(path)[name]
        out = torch.empty((stop - start, *spec.shape[1:]), dtype=spec.dtype)
        row = out[0].numel() * out.element_size() if out.dim() and len(out) else 0
        raw = out.view(torch.uint8).numpy() if out.numel() else None
        view = memoryview(raw).cast("B") if raw is not None else None  # type: ignore[arg-type]
        if view is not None:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [view], begin + start * row)
            finally:
                os.close(fd)
            if got != len(view):
                raise CheckpointError(f"{path} is truncated at {name}; re-save the weights")
        return out

    def _layout(self, path: Path) -> dict[str, tuple[Spec, int]]:
        """Each tensor's spec and the absolute offset of its bytes, from the header."""
        cached = self._layouts.get(path)
        if cached is None:
            cached = self._layouts[path] = _header_offsets(path, self.entries)
        return cached


class MappedSource(SlicedSource):
    """A state dict mapped from one of our own ``torch.save`` files (``weights_only``):
    a slice touches only its own pages."""

    def __init__(self, where: str, state: Mapping[str, torch.Tensor]) -> None:
        self.where, self.state = where, dict(state)
        self.entries = {k: Spec(tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        tensor = self.state[name]
        return tensor if index is None else tensor[index]

    def aliases(self) -> dict[str, str]:
        """The recorded table; for a checkpoint without one, the names that share one
        storage (the first name in order kept)."""
        if self.tied:
            return super().aliases()
        first: dict[tuple[Any, ...], str] = {}
        out = {}
        for name, tensor in self.state.items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype,
                   tuple(tensor.shape), tensor.stride())  # fmt: skip
            if tensor.numel() and key in first:
                out[name] = first[key]
            first.setdefault(key, name)
        return out

    def close(self) -> None:
        self.state.clear()


class DcpSource(Source):
    """A manygpu DCP checkpoint's model: DCP plans each rank's reads and reshards."""

    def __init__(self, step: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from manygpu.checkpoint_io.safe_dcp import SafeFileSystemReader

        self.where, self.step = str(step), step
        reader = SafeFileSystemReader(step, layout.read_meta(step)["files"])
        metadata = reader.read_metadata()
        self.entries = {
            key.removeprefix("model."): Spec(tuple(item.size), item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
        }

    def whole(self, names: Sequence[str]) -> Iterator[torch.Tensor]:
        """One ``dcp.load`` (in this process alone) for all of ``names``."""
        from manygpu.checkpoint_io.safe_dcp import safe_load

        state = {n: torch.empty(self.entries[n].shape, dtype=self.entries[n].dtype) for n in names}
        safe_load({"model": state}, self.step, no_dist=True)
        for name in names:
            yield state.pop(name)

    def fill(self, targets: Sequence[tuple[str, torch.Tensor]]) -> int:
        """One ``dcp.load`` (collective: every rank calls it once); a stored tensor
        that fills two of this rank's tensors (a pipeline stage's untied copy) is
        read into the first and copied into the other."""
        import torch.distributed as dist

        from manygpu.checkpoint_io.safe_dcp import safe_load

        first: dict[str, torch.Tensor] = {}
        extra = [(key, t) for key, t in targets if first.setdefault(key, t) is not t]
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        safe_load({"model": dict(first)}, self.step, no_dist=alone)
        for key, target in extra:
            shards.copy_part(target, first[key])
        return sum(shards.local_bytes(t) for _, t in targets)


def open_source(path: Path) -> Source:
    """The source ``path`` holds, decided by its structure; one-line errors otherwise."""
    if not path.exists():
        raise CheckpointError(
            f"weights path {path} does not exist; give a .safetensors file, a directory of "
            "them (Hugging Face style) or a manygpu checkpoint"
        )
    if path.is_file():
        if _is_pickle(path):
            raise pickle_refusal(path)
        return SafetensorsSource(str(path), {name: path for name in _names_in(path)})
    if (path / INDEX).is_file():
        return SafetensorsSource(str(path), _weight_map(path))
    if (path / SINGLE).is_file():
        return open_source(path / SINGLE)
    if (path / layout.META).is_file() or layout.committed(path):
        return open_checkpoint(path)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_refusal(path / pickles[0])
    raise CheckpointError(
        f"{path} holds no weights we read (no {SINGLE}, {INDEX}, or manygpu checkpoint); "
        "give a .safetensors file, a directory of them or a checkpoint"
    )


def _is_pickle(path: Path) -> bool:
    """By its name; a pickle named otherwise is caught when safetensors cannot read it."""
    return path.suffix in PICKLE_SUFFIXES


def _names_in(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # SafetensorError, OSError
        raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    """Why ``path`` is not safetensors: a pickle by its first bytes (checked only now: a
    safetensors header length can start with any byte), or what safetensors said."""
    with contextlib.suppress(OSError), open(path, "rb") as fh:
        if fh.read(4).startswith(_PICKLE_MAGIC):
            return pickle_refusal(path)
    return CheckpointError(
        f"{path} is not a readable safetensors file ({_first(exc)}); "
        "give a .safetensors file, a directory of them, or a manygpu checkpoint"
    )


def _weight_map(directory: Path) -> dict[str, Path]:
    """``name -> file`` from the index; every file a plain name inside ``directory``."""
    index = directory / INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        why = _first(exc)
        raise CheckpointError(f"{index} is not a weight index ({why}); re-save it") from None
    out = {}
    for name, file in weight_map.items():
        pure = PurePosixPath(file) if isinstance(file, str) else None
        if pure is None or len(pure.parts) != 1 or pure.name in ("", ".", ".."):
            raise CheckpointError(f"{index} puts {name!r} in {file!r}, not a file of {directory}")
        out[str(name)] = directory / pure.name
    for file in sorted(set(out.values())):
        if not file.is_file():
            raise CheckpointError(f"{index} names {file.name}, which is missing from {directory}")
        if _is_pickle(file):
            raise pickle_refusal(file)
    return out


def open_checkpoint(path: Path) -> Source:
    """A manygpu step directory (or the newest good one under a root), by its format.

    Sizes and the file table are checked; checksums are not (each rank reads only
    its slices; ``manygpu checkpoint inspect`` checks every byte).
    """
    step = layout.locate(path, hashes=False)
    layout.verify(step, hashes=False)
    source: Source
    if formats.detect(step) == "dcp":
        source = DcpSource(step)
    else:
        state = formats.load_file(step / formats.MODEL, mmap=True)
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint file {step / formats.MODEL} holds no state dict")
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        source = MappedSource(str(step), tensors)
    tied = layout.read_meta(step).get("tied")
    if isinstance(tied, dict):  # written by Checkpointer (weights.save.tie_table)
        source.tied = {k: v for k, v in tied.items() if isinstance(k, str) and isinstance(v, str)}
    return source


def _dtype(piece: Any, path: Path) -> torch.dtype:
    name = piece.get_dtype()
    if name not in DTYPES:
        raise CheckpointError(f"{path} holds a tensor of dtype {name}, which torch cannot hold")
    return DTYPES[name]


def _first(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines or [type(exc).__name__])[0][:200]


def _row_block(shape: tuple[int, ...], index: tuple[slice, ...] | None) -> tuple[int, int] | None:
    """``(start, stop)`` when ``index`` is whole rows (all of it, or a dim-0 block)."""
    if not shape:
        return None
    if index is None:
        return 0, shape[0]
    first, *rest = index
    whole = all(s.start in (0, None) and s.stop in (n, None) and s.step in (1, None)
                for s, n in zip(rest, shape[1:], strict=True))  # fmt: skip
    if not whole or first.step not in (1, None):
        return None
    return first.start or 0, shape[0] if first.stop is None else first.stop


def _header_offsets(path: Path, entries: Mapping[str, Spec]) -> dict[str, tuple[Spec, int]]:
    """Name -> (spec, absolute byte offset) for the tensors of ``path`` in ``entries``."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    base = 8 + size
    return {
        name: (entries[name], base + int(meta["data_offsets"][0]))
        for name, meta in header.items()
        if name != "__metadata__" and name in entries
    }
