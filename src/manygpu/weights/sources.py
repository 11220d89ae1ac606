"""Where weights come from: what a path holds is decided by its structure, never by trust.

- a ``.safetensors`` file (its header checked as ``safetensors`` checks it,
  :mod:`.st_read`, and read by byte ranges);
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
sources read for each DTensor exactly the block its rank owns. The same
sources at a URL (``s3://`` ...): :mod:`.url_sources`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from manygpu.checkpoint_io import formats, layout
from manygpu.errors import CheckpointError
from manygpu.weights import shards
from manygpu.weights.st_file import Spec
from manygpu.weights.st_read import ByteRanges, Layout, LocalRanges, read_header

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive; pickle protocol 2+
_CONVERT = (
    "convert it to safetensors where you trust it, e.g. transformers' "
    "save_pretrained(DIR, safe_serialization=True), or safetensors.torch.save_file("
    "{k: v.clone() for k, v in torch.load(FILE, weights_only=True).items()}, OUT)"
)


def pickle_refusal(path: object) -> CheckpointError:
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
    """One or more safetensors files, read by byte ranges (:mod:`.st_read`: a local file
    with ``pread``, an object in a store with ranged requests; the same code for both).

    ``files``: tensor name -> the file holding it (a Hugging Face index's map), or one
    file holding every tensor in it.
    """

    def __init__(self, where: str, files: Mapping[str, ByteRanges] | ByteRanges) -> None:
        self.where = where
        self._layouts: dict[str, Layout] = {}
        if isinstance(files, ByteRanges):
            files = dict.fromkeys(self._layout(files), files)
        self.files = dict(files)
        self.entries = {}
        for ranges in sorted({id(r): r for r in self.files.values()}.values(), key=_by_name):
            for name, (spec, _) in self._layout(ranges).items():
                if self.files.get(name) is ranges:
                    self.entries[name] = spec
        lost = sorted(set(self.files) - set(self.entries))
        if lost:
            held_by = posixpath.basename(self.files[lost[0]].name)
            raise CheckpointError(
                f"{where} is damaged: its index puts {lost[0]} in {held_by}, "
                f"which does not hold it ({len(lost)} such); re-save the weights"
            )

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        shape = self.entries[name].shape
        if not shape:  # a 0-d tensor has no rows
            return self._rows(name, 0, 1)
        rows = _row_block(shape, index)
        if rows is not None:
            return self._rows(name, *rows)
        # Columns (a row-parallel weight's share): the tensor's rows read whole, one
        # tensor in flight, and this rank's block copied out of them.
        assert index is not None
        first = index[0]
        whole = self._rows(name, first.start or 0, shape[0] if first.stop is None else first.stop)
        block = [slice(None), *index[1:]]
        return whole[tuple(block)].clone()

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of ``name`` (all of a 0-d tensor) read into fresh memory:
        one block of rows is one byte range of the file."""
        ranges = self.files[name]
        spec, begin = self._layout(ranges)[name]
        out = torch.empty((stop - start, *spec.shape[1:]) if spec.shape else (), dtype=spec.dtype)
        if out.numel():
            raw = out.reshape(-1).view(torch.uint8).numpy()
            view = memoryview(raw).cast("B")  # type: ignore[arg-type]
            row = len(view) // (stop - start)
            if ranges.read_into(view, begin + start * row) != len(view):
                raise CheckpointError(f"{ranges.name} is truncated at {name}; re-save the weights")
        return out

    def _layout(self, ranges: ByteRanges) -> Layout:
        """Each tensor's spec and offset, from the file's header (read once)."""
        cached = self._layouts.get(ranges.name)
        if cached is None:
            try:
                cached = self._layouts[ranges.name] = read_header(ranges)
            except ValueError as exc:
                raise _unreadable(ranges, exc) from None
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
        if _is_pickle(path.name):
            raise pickle_refusal(path)
        return SafetensorsSource(str(path), LocalRanges(path))
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


def _is_pickle(name: str) -> bool:
    """By its name; a pickle named otherwise is caught when its header does not parse."""
    return PurePosixPath(name).suffix in PICKLE_SUFFIXES


def _by_name(ranges: ByteRanges) -> str:
    return ranges.name


def _unreadable(ranges: ByteRanges, exc: BaseException) -> CheckpointError:
    """Why ``ranges``' file is not safetensors: a pickle by its first bytes (checked only
    now: a safetensors header length can start with any byte), or what is wrong with it."""
    with contextlib.suppress(OSError):
        if ranges.read(0, 4).startswith(_PICKLE_MAGIC):
            return pickle_refusal(ranges.name)
    return CheckpointError(
        f"{ranges.name} is not a readable safetensors file ({_first(exc)}); "
        "give a .safetensors file, a directory of them, or a manygpu checkpoint"
    )


def parse_index(raw: bytes, index: object, directory: object) -> dict[str, str]:
    """``name -> file name`` from an index's bytes; every file a plain name (no path), so an
    index never reaches outside its ``directory``; pickles refused by name."""
    try:
        weight_map = json.loads(raw.decode("utf-8"))["weight_map"]
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
        out[str(name)] = pure.name
    for file in sorted(set(out.values())):
        if _is_pickle(file):
            raise pickle_refusal(f"{directory}/{file}")
    return out


def _weight_map(directory: Path) -> dict[str, ByteRanges]:
    """``name -> file`` from the index, each file inside ``directory``."""
    names = parse_index((directory / INDEX).read_bytes(), directory / INDEX, directory)
    files: dict[str, ByteRanges] = {}
    for file in sorted(set(names.values())):
        if not (directory / file).is_file():
            raise CheckpointError(
                f"{directory / INDEX} names {file}, which is missing from {directory}"
            )
        files[file] = LocalRanges(directory / file)
    return {name: files[file] for name, file in names.items()}


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
