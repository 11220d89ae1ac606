"""Read ``torch.distributed.checkpoint`` directories without running their code.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` and
its default planner loads non-tensor items ("bytes": optimizer hyper-parameters,
scheduler state) with an unrestricted ``torch.load``: a crafted checkpoint
directory runs code as whoever resumes, inspects or exports it. Here:

- ``.metadata`` is read by an unpickler that only builds DCP's own metadata
  records, ``torch.Size``, dtypes / layouts / memory formats and paths; any
  other global (``os.system``, ``builtins.eval`` ...) is refused with a
  :class:`CheckpointError` naming it;
- bytes items load with ``weights_only=True`` (tensors, numbers, strings,
  containers: all an optimizer's or scheduler's state needs);
- every file it reads (``.metadata``, and each shard file the metadata names)
  must be one that ``meta.json`` lists, inside the checkpoint directory with
  symlinks resolved: a crafted ``relative_path`` (absolute, or ``../``) would
  otherwise read another checkpoint's weights, past every checksum.
"""

from __future__ import annotations

import io
import pickle
import posixpath
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from manygpu.checkpoint_io import layout
from manygpu.checkpoint_io.formats import SHARDS
from manygpu.errors import CheckpointError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = {
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a name -> layout lookup, nothing more
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only what DCP metadata is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE and name in _METADATA_CLASSES:
            return super().find_class(module, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of a DCP "
            "checkpoint; refusing to load it (the file may be crafted to run code)"
        )


def load_metadata(stream: Any) -> Metadata:
    """Unpickle DCP metadata from ``stream`` with the allow-list; anything else is refused."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"checkpoint metadata cannot be read: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint metadata holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


class _Refusals:
    """Remembers why we refused: DCP wraps errors in a multi-rank traceback dump."""

    refused: CheckpointError | None = None

    def _refuse(self, error: CheckpointError) -> CheckpointError:
        if self.refused is None:  # the first: DCP retries with another metadata file
            self.refused = error
        return error


class SafeFileSystemReader(_Refusals, FileSystemReader):
    """``FileSystemReader`` of ``checkpoint/shards`` that reads only files ``meta.json`` lists.

    Its metadata comes through :func:`load_metadata`; every file name in it is
    checked (:meth:`_listed`) before DCP opens anything.
    """

    def __init__(self, checkpoint: Path, listed: Mapping[str, Any]) -> None:
        super().__init__(checkpoint / SHARDS)
        self.checkpoint, self.listed = checkpoint, listed

    def _listed(self, relative: Any) -> None:
        """Refuse ``relative`` (a path under shards/) unless meta.json lists it, inside."""
        where = f"checkpoint {self.checkpoint} is damaged: its DCP metadata reads {relative!r}"
        if not isinstance(relative, str) or not relative:
            raise self._refuse(CheckpointError(f"{where}, which is not a file name"))
        pure = PurePosixPath(relative)
        if pure.is_absolute() or ".." in pure.parts:
            raise self._refuse(
                CheckpointError(f"{where}, which is outside the checkpoint directory")
            )
        name = posixpath.normpath(f"{SHARDS}/{relative}")
        if name not in self.listed:
            raise self._refuse(CheckpointError(f"{where}, which its meta.json does not list"))
        try:
            layout.inside(self.checkpoint, name)
        except CheckpointError as exc:
            raise self._refuse(exc) from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        self._listed(Path(path).name)
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = load_metadata(stream)
            except CheckpointError as exc:
                raise self._refuse(exc) from None
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        # Every rank passes here before its first read_data: the one place to
        # check the file of every shard, whoever read the metadata.
        storage = metadata.storage_data
        if not isinstance(storage, dict):
            raise self._refuse(
                CheckpointError(f"checkpoint {self.checkpoint}'s DCP metadata lists no shards")
            )
        for info in storage.values():
            self._listed(getattr(info, "relative_path", None))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


class _WeightsOnlyBytes(_Refusals):
    """Planner mixin: non-tensor items load with ``weights_only=True`` or are refused."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise self._refuse(
                CheckpointError(
                    f"checkpoint item {read_item.dest_index.fqn!r} is not plain data "
                    f"(refused; weights-only load failed: {str(exc).splitlines()[0][:200]})"
                )
            ) from None
        # Stored as DefaultLoadPlanner.load_bytes would, without its unsafe torch.load.
        fqn = read_item.dest_index.fqn
        if getattr(self, "flatten_state_dict", False):
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[fqn] = obj  # type: ignore[attr-defined]


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``weights_only=True``."""


def safe_full_planner() -> DefaultLoadPlanner:
    """A planner that loads a whole checkpoint into an empty dict (for export), safely."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner

    class _SafeEmpty(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
        pass

    return _SafeEmpty()


def safe_load(state: dict[str, Any], checkpoint: Path, *, whole: bool = False, **kw: Any) -> None:
    """``dcp.load`` of ``checkpoint``'s shards through the safe reader and planner.

    ``whole=True`` fills an empty ``state`` with everything saved (export);
    otherwise the keys of ``state`` are loaded in place (resume). A refusal
    surfaces as itself; any other DCP failure becomes a one-line
    :class:`CheckpointError` too.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, load

    directory = checkpoint / SHARDS
    reader = SafeFileSystemReader(checkpoint, layout.read_meta(checkpoint)["files"])
    planner = safe_full_planner() if whole else SafeLoadPlanner()
    try:
        if whole:  # torch's own "load everything" path, as its format_utils use it
            _load_state_dict(state, storage_reader=reader, planner=planner, **kw)
        else:
            load(state, storage_reader=reader, planner=planner, **kw)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        refused = reader.refused or getattr(planner, "refused", None)
        if refused is not None:
            raise refused from None
        lines = [ln for ln in str(exc).splitlines() if ln.strip() and not ln.startswith(" ")]
        last = (lines or [type(exc).__name__])[-1][:300]
        raise CheckpointError(f"checkpoint {directory} cannot be loaded: {last}") from None
