"""Checksums of checkpoint files, computed while the bytes stream to disk.

A file's checksum (``meta.json`` schema 2) is a list of CRC-32s (zlib's
polynomial), one per :data:`SEGMENT` bytes, written as 8 hex digits each. They
are computed with ``zlib-ng`` (:data:`crc32`): the same CRC-32 values as the
standard library's ``zlib``, with the CPU's carry-less multiply instead of
tables, about 9 GB/s on one core here against ``zlib``'s 3.4 (and SHA-256's
1.4, schema 1: one SHA-256 per file cannot be split over cores either; it was
the slowest part of a save and of a resume). Where ``zlib-ng`` cannot be
installed the standard library computes the same values, slower. Segments
hash on every core at once (both release the GIL for large buffers), both
while a file is written (:class:`StreamDigest`, fed the same
buffers the writer writes: the bytes are never read back) and when a resume
verifies a file (:func:`file_digest`, over a read-only memory map of the page
cache); a mismatch names the damaged byte range. The checksum guards against
damage (a torn write, a flipped bit, a truncated copy), as SHA-256 did here:
``meta.json`` is not signed, so neither ever stopped a deliberate edit.

Schema 1 checkpoints (a plain SHA-256 per file) still verify: :func:`file_digest`
takes the schema.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:
    from zlib_ng.zlib_ng import crc32 as _fast_crc32
except ImportError:  # no wheel for this platform: the same CRC-32, from the standard library
    from zlib import crc32 as _fast_crc32

crc32: Callable[[Any, int], int] = _fast_crc32
"""``crc32(data, start)``: zlib's CRC-32 (``zlib-ng``'s SIMD code where installed)."""

SEGMENT = 16 << 20
"""Bytes per independently checked segment (schema 2)."""
CHECKSUM = "crc32-per-16MiB"
"""The name ``meta.json`` records for this scheme (schema 2)."""
HEX = 8
"""Hex digits per segment's CRC-32 in the file table."""
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


def _hex(crcs: list[int]) -> str:
    return "".join(f"{c:08x}" for c in crcs)


class _Segment:
    """A segment's running CRC-32 (pieces of one segment arrive in order)."""

    __slots__ = ("crc",)

    def __init__(self) -> None:
        self.crc = 0

    def update(self, piece: memoryview) -> None:
        self.crc = crc32(piece, self.crc)


class StreamDigest:
    """The schema-2 checksum of a byte stream, fed in order, computed on ``pool``'s threads.

    :meth:`feed` returns the futures checksumming the caller's buffer; the
    caller waits for them before it lets the buffer go (it is not copied).
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._segments: list[_Segment] = []  # finished ones, in order
        self._current = _Segment()
        self._filled = 0
        self.size = 0

    def feed(self, data: memoryview) -> list[Future[None]]:
        """Checksum ``data`` (the stream's next bytes); wait for the returned futures."""
        jobs: list[Future[None]] = []
        pos, n = 0, len(data)
        while pos < n:
            take = min(SEGMENT - self._filled, n - pos)
            piece, segment = data[pos : pos + take], self._current
            if take >= _INLINE:  # each segment gets at most one piece per call: order holds
                jobs.append(self._pool.submit(segment.update, piece))
            else:
                segment.update(piece)
            self._filled += take
            if self._filled == SEGMENT:
                self._segments.append(segment)
                self._current, self._filled = _Segment(), 0
            pos += take
        self.size += n
        return jobs

    def hexdigest(self) -> str:
        """The file's checksum (call after every future of :meth:`feed` finished)."""
        crcs = [s.crc for s in self._segments]
        if self._filled:
            crcs.append(self._current.crc)
        return _hex(crcs)


def file_digest(path: Path, pool: ThreadPoolExecutor, *, schema: int = 2) -> str:
    """The checksum ``meta.json`` lists for ``path`` under ``schema`` (1: plain SHA-256)."""
    if schema == 1:
        return _plain_sha256(path)
    if path.stat().st_size == 0:
        return ""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        segments = [view[i : i + SEGMENT] for i in range(0, len(view), SEGMENT)]
        try:
            crcs = list(pool.map(lambda s: crc32(s, 0), segments))
        finally:
            for segment in segments:
                segment.release()
            view.release()
    return _hex(crcs)


def first_damage(listed: str, found: str) -> tuple[int, int]:
    """The byte range of the first segment whose checksum differs (schema 2)."""
    for i in range(0, max(len(listed), len(found)), HEX):
        if listed[i : i + HEX] != found[i : i + HEX]:
            start = i // HEX * SEGMENT
            return start, start + SEGMENT
    return 0, 0


def _plain_sha256(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
