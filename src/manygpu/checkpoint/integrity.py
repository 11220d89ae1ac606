"""Checksums of checkpoint files, computed while the bytes stream to disk.

A file's checksum (``meta.json`` schema 2) is a two-level SHA-256: the file is
cut into :data:`SEGMENT`-byte segments, each segment is hashed on its own, and
the file's digest is the SHA-256 of the segments' digests in order. Why not a
plain SHA-256 of the file (schema 1): one SHA-256 runs on one core at about
1.5 GB/s, slower than writing to the page cache, so it would be the slowest
part of a save and of a resume. Segments hash on every core at once
(``hashlib`` releases the GIL for large buffers), both while a file is written
(:class:`StreamDigest`, fed the same buffers the writer writes: the bytes are
never read back) and when a resume verifies a file (:func:`file_digest`, over a
read-only memory map of the page cache).

Schema 1 checkpoints (a plain SHA-256 per file) still verify: :func:`file_digest`
takes the schema.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SEGMENT = 16 << 20
"""Bytes per independently hashed segment (schema 2)."""
CHECKSUM = "sha256-segments-16MiB"
"""The name ``meta.json`` records for this scheme (schema 2)."""
_INLINE = 256 << 10
"""Pieces smaller than this are hashed on the calling thread (a hand-off costs more)."""


def workers(*, every_core: bool = False) -> int:
    """Hashing threads: every core but the writer's (or every core), from 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 2) - (0 if every_core else 1)))


@contextmanager
def hashing_pool(*, every_core: bool = False) -> Iterator[ThreadPoolExecutor]:
    """Threads that hash segments; one pool per save or verification, never global.

    ``every_core`` when the calling thread only waits (verification); a writer
    keeps one core for its own ``write`` calls.
    """
    pool = ThreadPoolExecutor(
        max_workers=workers(every_core=every_core), thread_name_prefix="manygpu-hash"
    )
    try:
        yield pool
    finally:
        pool.shutdown(wait=True)


def _root(segment_digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(segment_digests)).hexdigest()


class StreamDigest:
    """The schema-2 digest of a byte stream, fed in order, hashed on ``pool``'s threads.

    :meth:`feed` returns the futures hashing the caller's buffer; the caller
    waits for them before it lets the buffer go (the buffer is not copied).
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._segments: list[Any] = []  # finished segments' hash objects, in order
        self._current = hashlib.sha256()
        self._filled = 0
        self.size = 0

    def feed(self, data: memoryview) -> list[Future[None]]:
        """Hash ``data`` (the stream's next bytes); wait for the returned futures."""
        jobs: list[Future[None]] = []
        pos, n = 0, len(data)
        while pos < n:
            take = min(SEGMENT - self._filled, n - pos)
            piece, hasher = data[pos : pos + take], self._current
            if take >= _INLINE:  # each hasher gets at most one piece per call: order holds
                jobs.append(self._pool.submit(hasher.update, piece))
            else:
                hasher.update(piece)
            self._filled += take
            if self._filled == SEGMENT:
                self._segments.append(hasher)
                self._current, self._filled = hashlib.sha256(), 0
            pos += take
        self.size += n
        return jobs

    def hexdigest(self) -> str:
        """The file's digest (call after every future of :meth:`feed` finished)."""
        digests = [h.digest() for h in self._segments]
        if self._filled:
            digests.append(self._current.digest())
        return _root(digests)


def _segment_digest(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def file_digest(path: Path, pool: ThreadPoolExecutor, *, schema: int = 2) -> str:
    """The digest ``meta.json`` lists for ``path`` under ``schema`` (1: plain SHA-256)."""
    size = path.stat().st_size
    if schema == 1:
        return _plain_sha256(path)
    if size == 0:
        return _root([])
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            segments = [view[i : i + SEGMENT] for i in range(0, len(view), SEGMENT)]
            digests = list(pool.map(_segment_digest, segments))
            for segment in segments:
                segment.release()
        finally:
            view.release()
    return _root(digests)


def _plain_sha256(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
