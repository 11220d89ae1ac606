"""Where a checkpointer's steps live: a local directory, or a URL of an object store.

One small interface, :class:`Store`, with two implementations, so the
checkpointer never branches on the kind of location:

- :class:`LocalStore`: exactly the disk behaviour of :mod:`.layout` (write
  ``step-N.tmp``, fsync, ``meta.json`` last, rename to ``step-N``);
- :class:`UrlStore`: any fsspec URL (:mod:`.remote`, :mod:`.remote_layout`):
  objects written straight to ``step-N/``, ``meta.json`` last is the commit,
  nothing renamed. A resume downloads the chosen step into a local temporary
  directory (:meth:`Store.local_copy`), verifies it there and loads it with
  the same readers as a disk checkpoint (no pickle, ``weights_only``).

:func:`open_store` picks one from what the user gave.
"""

from __future__ import annotations

import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from manygpu.checkpoint_io import layout, remote, remote_layout
from manygpu.checkpoint_io.remote import Url
from manygpu.errors import UsageError

Location = Path | Url
"""A step directory: a local path, or a location in a store."""


class Store(ABC):
    """The operations a checkpointer performs on the place its steps live."""

    root: Location

    @abstractmethod
    def slots(self, step: int) -> tuple[Location, Location]:
        """Where step ``step`` is written, and where it is once committed."""

    @abstractmethod
    def prepare(self, tmp: Location) -> None:
        """Main rank, before a save: clear what a crashed save left; make room for ``tmp``."""

    def visible(self, tmp: Location) -> bool:
        """Whether this rank sees ``tmp`` (a shared filesystem's check)."""
        return True

    def probe(self, rank: int) -> str | None:
        """What keeps rank ``rank`` from writing here, in one line (``None``: nothing)."""
        return None

    @abstractmethod
    def commit(
        self,
        tmp: Location,
        final: Location,
        meta: dict[str, Any],
        table: dict[str, dict[str, Any]],
    ) -> None:
        """Main rank: check the objects, write ``meta.json`` last, make the step count."""

    @abstractmethod
    def prune(self, keep: int) -> None:
        """Delete good steps older than the newest ``keep`` good ones."""

    @abstractmethod
    def discard(self, tmp: Location) -> None:
        """Main rank: remove what a failed save wrote."""

    def failure(self, exc: BaseException, tmp: Location, files: Any = None) -> str:
        """A write error in words (a full disk named as one where there is a disk)."""
        text = str(exc).strip()
        return text.splitlines()[0][:240] if text else type(exc).__name__

    @abstractmethod
    def location(self, value: str) -> Location:
        """The step named by ``value`` (what :func:`str` of a location gave, or a path)."""

    @abstractmethod
    def step(self, step: int) -> Location:
        """Where a committed step ``step`` is."""

    @contextmanager
    def local_copy(self, where: Location) -> Iterator[Path]:
        """A local directory holding ``where``'s files, for the readers (itself on disk)."""
        assert isinstance(where, Path)
        yield where


class LocalStore(Store):
    """A directory on a filesystem every rank shares: today's disk behaviour, unchanged."""

    def __init__(self, root: Path) -> None:
        if root.exists() and not root.is_dir():
            raise UsageError(f"checkpoint directory {root} is a file; give a directory")
        self.root: Path = root

    def slots(self, step: int) -> tuple[Location, Location]:
        return layout.tmp_dir(self.root, step), layout.step_dir(self.root, step)

    def prepare(self, tmp: Location) -> None:
        assert isinstance(tmp, Path)
        layout.remove_stale(self.root)
        tmp.mkdir(parents=True, exist_ok=True)

    def visible(self, tmp: Location) -> bool:
        return isinstance(tmp, Path) and tmp.is_dir()

    def commit(
        self,
        tmp: Location,
        final: Location,
        meta: dict[str, Any],
        table: dict[str, dict[str, Any]],
    ) -> None:
        assert isinstance(tmp, Path) and isinstance(final, Path)
        layout.commit(tmp, final, meta, table)

    def prune(self, keep: int) -> None:
        layout.prune(self.root, keep)

    def discard(self, tmp: Location) -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # type: ignore[arg-type]

    def failure(self, exc: BaseException, tmp: Location, files: Any = None) -> str:
        assert isinstance(tmp, Path)
        return layout.write_failure(exc, tmp, files)

    def location(self, value: str) -> Location:
        return Path(value)

    def step(self, step: int) -> Location:
        return layout.step_dir(self.root, step)


class UrlStore(Store):
    """A prefix in an object store (any fsspec URL): commit by ``meta.json`` alone."""

    def __init__(self, root: Url) -> None:
        self.root: Url = root

    def probe(self, rank: int) -> str | None:
        return remote.probe(self.root, rank)

    def slots(self, step: int) -> tuple[Location, Location]:
        where = self.root / layout.step_dir(Path(), step).name
        return where, where  # written where it stays: no rename in a store

    def prepare(self, tmp: Location) -> None:
        # Saves that never committed, and the same step saved before (there is no
        # rename to replace it with at the end: it goes now).
        assert isinstance(tmp, Url)
        remote_layout.remove_stale(self.root)
        remote_layout.remove(tmp)

    def commit(
        self,
        tmp: Location,
        final: Location,
        meta: dict[str, Any],
        table: dict[str, dict[str, Any]],
    ) -> None:
        assert isinstance(final, Url)
        remote_layout.commit(final, meta, table)

    def prune(self, keep: int) -> None:
        remote_layout.prune(self.root, keep)

    def discard(self, tmp: Location) -> None:
        assert isinstance(tmp, Url)
        remote_layout.remove(tmp)

    def location(self, value: str) -> Location:
        if value.startswith(str(self.root)):
            rest = value[len(str(self.root)) :].strip("/")
            return self.root / rest if rest else self.root
        return remote.connect(value) if remote.is_url(value) else self.root / value

    def step(self, step: int) -> Location:
        return self.slots(step)[1]

    @contextmanager
    def local_copy(self, where: Location) -> Iterator[Path]:
        """Download ``where`` into a temporary directory, verified there; removed afterwards."""
        assert isinstance(where, Url)
        into = Path(tempfile.mkdtemp(prefix="manygpu-ckpt-"))
        try:
            yield remote_layout.fetch(where, into)
        finally:
            shutil.rmtree(into, ignore_errors=True)


def open_store(location: str | Path, storage_options: dict[str, Any] | None = None) -> Store:
    """The store for a checkpointer's ``directory``: a URL's, or a local directory's.

    ``storage_options`` go to fsspec as they are (only with a URL).
    """
    if remote.is_url(location):
        return UrlStore(remote.connect(str(location), storage_options))
    if storage_options:
        raise UsageError(
            f"storage_options are for URLs (s3://bucket/prefix ...); {location} is a local path"
        )
    return LocalStore(Path(location))
