"""Weights at a URL (``s3://``, ``gs://``, ``az://``, ``memory://`` ... any fsspec store).

The same three things :mod:`.sources` reads on disk, decided by the same
structure:

- a ``.safetensors`` object, or a Hugging Face-style prefix (``model.safetensors``,
  or ``model.safetensors.index.json`` and the files it names): the header is
  fetched with one ranged request and checked (:mod:`.st_read`), then each rank
  fetches only the byte ranges of its own row blocks (:class:`~.st_read.UrlRanges`),
  never the whole file: an FSDP rank of ``N`` pulls about ``1/N`` of the bytes
  (a row-parallel weight's rows whole, as on disk);
- a manygpu checkpoint step, or the root holding steps (the newest whose
  objects have the sizes its ``meta.json`` lists): every rank downloads the
  step into a temporary directory (``TMPDIR``) through the checkpointer's own
  :func:`~manygpu.checkpoint_io.remote_layout.fetch`, which verifies it there
  (sizes and checksums), reads it with the disk readers (no pickle) and
  deletes the copy when the load ends. A DCP step is read whole by each rank
  this way: simple and verified, at the cost of a full download per rank.

Configuration is the store library's (for S3 the ``AWS_*`` variables, config
files, instance roles) plus ``storage_options`` handed to fsspec as given, as
the checkpointer does. A missing backend is the checkpointer's one line naming
the extra; a missing object, a refused credential or a missing bucket is one
:class:`~manygpu.errors.CheckpointError` line.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from manygpu.checkpoint_io import layout, remote, remote_layout
from manygpu.checkpoint_io.remote import Url
from manygpu.errors import CheckpointError, UsageError
from manygpu.weights.sources import (
    INDEX,
    PICKLE_SUFFIXES,
    SINGLE,
    SafetensorsSource,
    Source,
    open_checkpoint,
    parse_index,
    pickle_refusal,
)
from manygpu.weights.st_read import ByteRanges, UrlRanges

_GIVE = "give a .safetensors file, a directory of them (Hugging Face style) or a manygpu checkpoint"


def resolve(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Path | Url:
    """Where ``weights=`` points: a local path, or a location in a store.

    Cheap (no request is made): a missing backend or options the backend does
    not take are one :class:`UsageError` line, before anything is allocated.
    A ``file://`` URL is a local path.
    """
    from fsspec.implementations.local import LocalFileSystem

    if remote.is_url(path):
        url = remote.connect(str(path), storage_options, what="weights URL")
        return Path(url.path) if isinstance(url.fs, LocalFileSystem) else url
    if storage_options:
        raise UsageError(
            f"storage options are for weights URLs (s3://bucket/model.safetensors ...); "
            f"{path} is a local path"
        )
    return Path(path)


def open_url_source(url: Url) -> Source:
    """The source at ``url``, decided by its structure; one-line errors otherwise."""
    try:
        return _open(url)
    except OSError as exc:  # refused credentials, a missing bucket, the network
        raise CheckpointError(f"cannot read weights at {url} ({remote.why(exc)})") from None


def _open(url: Url) -> Source:
    url.fs.invalidate_cache(url.path)  # other processes may have written here since
    try:
        info = url.fs.info(url.path)
    except FileNotFoundError:
        raise CheckpointError(f"weights path {url} does not exist; {_GIVE}") from None
    if info.get("type") == "file":
        return _single(url, info)
    children = {
        posixpath.basename(str(child["name"]).rstrip("/")): child
        for child in url.fs.ls(url.path, detail=True)
    }
    if INDEX in children:
        return _indexed(url, children)
    if SINGLE in children:
        return _single(url / SINGLE, children[SINGLE])
    if layout.META in children or remote_layout.committed(url):
        return _checkpoint(url, layout.META in children)
    pickles = sorted(n for n in children if posixpath.splitext(n)[1] in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_refusal(url / pickles[0])
    raise CheckpointError(
        f"{url} holds no weights we read (no {SINGLE}, {INDEX}, or manygpu checkpoint); {_GIVE}"
    )


def _single(url: Url, info: dict[str, Any]) -> Source:
    if posixpath.splitext(url.name)[1] in PICKLE_SUFFIXES:
        raise pickle_refusal(url)
    return SafetensorsSource(str(url), UrlRanges(url, int(info["size"])))


def _indexed(url: Url, children: dict[str, dict[str, Any]]) -> Source:
    """A Hugging Face sharded prefix: the index, then each file it names (sizes from the
    one listing already made)."""
    names = parse_index(url.fs.cat_file((url / INDEX).path), url / INDEX, url)
    files: dict[str, ByteRanges] = {}
    for file in sorted(set(names.values())):
        child = children.get(file)
        if child is None or child.get("type") != "file":
            raise CheckpointError(f"{url / INDEX} names {file}, which is missing from {url}")
        files[file] = UrlRanges(url / file, int(child["size"]))
    return SafetensorsSource(str(url), {name: files[file] for name, file in names.items()})


def _checkpoint(url: Url, is_step: bool) -> Source:
    """A step (or the newest good one under a root) downloaded, verified, read from disk."""
    step = url if is_step else _newest(url)
    into = Path(tempfile.mkdtemp(prefix="manygpu-weights-"))
    try:
        return Fetched(open_checkpoint(remote_layout.fetch(step, into)), str(step), into)
    except BaseException:
        shutil.rmtree(into, ignore_errors=True)
        raise


def _newest(root: Url) -> Url:
    """The newest step whose objects have their listed sizes (checksums are checked once,
    after the download, rather than by reading every object twice)."""
    for candidate in reversed(remote_layout.committed(root)):
        try:
            return remote_layout.verify(candidate, hashes=False).path  # type: ignore[return-value]
        except CheckpointError:
            continue
    raise CheckpointError(f"no complete checkpoint in {root}")


class Fetched(Source):
    """A checkpoint source read from a downloaded copy, named by its URL; the copy is
    deleted on :meth:`close`."""

    def __init__(self, inner: Source, where: str, into: Path) -> None:
        self.inner, self.where, self.entries, self._into = inner, where, inner.entries, into

    def fill(self, targets: Sequence[tuple[str, torch.Tensor]]) -> int:
        return self.inner.fill(targets)

    def whole(self, names: Sequence[str]) -> Iterator[torch.Tensor]:
        return self.inner.whole(names)

    def distinct(self) -> list[str]:
        return self.inner.distinct()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            shutil.rmtree(self._into, ignore_errors=True)
