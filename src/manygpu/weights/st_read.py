"""Reading safetensors by byte ranges: a local file with ``pread``, an object with ranged GETs.

A rank of a sharded model needs a few blocks of rows of each tensor, and a
block of rows is one byte range of the file. :class:`ByteRanges` is the one
operation the reader needs, "these bytes, into this buffer", with two
implementations: :class:`LocalRanges` (``os.preadv`` into fresh memory, not a
memory map: mapped pages count in the process's resident set while the file is
open, so each rank's share would show twice) and :class:`UrlRanges` (ranged
requests through fsspec: ``cat_ranges`` of pieces of :data:`PIECE_BYTES`,
:data:`PIECES_AT_ONCE` at a time, so a rank fetches only its own rows and never
downloads the whole file).

The header is parsed here rather than by ``safetensors`` (which reads local
files only): :func:`parse_header` checks the same structure safetensors does
(length, JSON object, known dtypes, every tensor's byte count from its shape,
offsets back to back and ending where the file does). Nothing read is executed.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from manygpu.checkpoint_io.remote import Url
from manygpu.weights.st_file import DTYPES, Spec

MAX_HEADER = 100_000_000
"""The longest header accepted (safetensors' own limit): a damaged length is refused
before anything that large is allocated."""
HEADER_PROBE = 1 << 16
"""Bytes fetched first: the length and, for all but huge headers, the header itself in
one request (a remote file's round trip costs more than the bytes)."""
PIECE_BYTES = 16 << 20
"""A remote range is fetched in pieces of this size: each is one request and one copy."""
PIECES_AT_ONCE = 8
"""Pieces requested together (concurrently on async stores such as s3fs): the bytes in
flight beside the destination stay under ``PIECES_AT_ONCE * PIECE_BYTES`` (128 MiB)."""

Layout = dict[str, tuple[Spec, int]]
"""Tensor name -> its spec and the absolute offset of its first byte in the file."""


class ByteRanges(ABC):
    """Byte ranges of one file, wherever it is."""

    name: str
    """How messages name the file (its path or URL)."""

    @abstractmethod
    def size(self) -> int:
        """The file's length in bytes."""

    @abstractmethod
    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from byte ``offset``; returns how many bytes there were (fewer at
        the file's end)."""

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        got = self.read_into(memoryview(buf), offset)
        return bytes(buf[:got])


class LocalRanges(ByteRanges):
    """A local file, read with ``pread`` (opened per read: no descriptor held between)."""

    def __init__(self, path: Path) -> None:
        self.path, self.name = path, str(path)
        self._size: int | None = None

    def size(self) -> int:
        if self._size is None:
            self._size = os.stat(self.path).st_size
        return self._size

    def read_into(self, view: memoryview, offset: int) -> int:
        done = 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            # One call reads at most ~2 GiB on Linux: go on until full or at the end.
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    break
                done += got
        finally:
            os.close(fd)
        return done


class UrlRanges(ByteRanges):
    """An object in a store, read by ranged requests (its size known from a listing)."""

    def __init__(self, url: Url, size: int) -> None:
        self.url, self.name, self._size = url, str(url), size

    def size(self) -> int:
        return self._size

    def read_into(self, view: memoryview, offset: int) -> int:
        stop = min(offset + len(view), self._size)
        starts = list(range(offset, stop, PIECE_BYTES))
        for first in range(0, len(starts), PIECES_AT_ONCE):
            group = starts[first : first + PIECES_AT_ONCE]
            ends = [min(s + PIECE_BYTES, stop) for s in group]
            pieces = self.url.fs.cat_ranges([self.url.path] * len(group), group, ends,
                                            on_error="raise")  # fmt: skip
            for start, end, piece in zip(group, ends, pieces, strict=True):
                if isinstance(piece, BaseException):  # a backend that returns them anyway
                    raise piece
                if len(piece) != end - start:
                    raise OSError(f"{self.name} sent {len(piece)} bytes for {end - start}")
                view[start - offset : end - offset] = piece
        return max(stop - offset, 0)


def read_header(ranges: ByteRanges) -> Layout:
    """The header of ``ranges``' file, checked (:func:`parse_header`); ``ValueError`` says why."""
    size = ranges.size()
    head = ranges.read(0, min(size, HEADER_PROBE))
    if len(head) < 8:
        raise ValueError(f"{size} bytes is shorter than the 8-byte header length")
    length = int.from_bytes(head[:8], "little")
    if length > MAX_HEADER:
        raise ValueError(f"a header of {length} bytes is over the {MAX_HEADER} allowed")
    if 8 + length > size:
        raise ValueError(f"a header of {length} bytes is past the end of the file")
    text = head[8 : 8 + length]
    if len(text) < length:
        text += ranges.read(len(head), 8 + length - len(head))
    return parse_header(text, size - 8 - length, 8 + length)


def parse_header(text: bytes, data_bytes: int, base: int) -> Layout:
    """Each tensor's spec and absolute offset, from a header of ``data_bytes`` of tensors.

    The checks are safetensors' own: a JSON object (no key twice), each tensor a
    known dtype and a shape whose byte count its ``data_offsets`` span, the
    spans back to back from 0 and ending at the end of the file. Names sorted,
    as ``safe_open().keys()`` gives them.
    """
    try:
        table = json.loads(text.decode("utf-8"), object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"its header is not JSON: {exc}") from None
    if not isinstance(table, dict) or not text.startswith(b"{"):
        raise ValueError("its header is not a JSON object")
    meta = table.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("its __metadata__ is not an object of strings")
    spans = sorted(((*_span(name, entry), name) for name, entry in table.items()),
                   key=lambda s: (s[0], s[1], s[3]))  # fmt: skip
    end = 0
    out: Layout = {}
    for begin, stop, spec, name in spans:
        if begin != end:
            raise ValueError(f"{name}'s bytes start at {begin}, not at {end}")
        if stop - begin != spec.nbytes:
            raise ValueError(f"{name} is {spec.shape} {spec.dtype} but spans {stop - begin} bytes")
        out[name], end = (spec, base + begin), stop
    if end != data_bytes:
        raise ValueError(f"its tensors end at byte {end} of {data_bytes}: the file is damaged")
    return dict(sorted(out.items()))


def _span(name: str, entry: Any) -> tuple[int, int, Spec]:
    """``(begin, end, spec)`` of one header entry, its types checked."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{name!r} is not a tensor entry (dtype, shape, data_offsets)")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {dtype}, which torch cannot hold")
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise ValueError(f"{name} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
        raise ValueError(f"{name} has data_offsets {offsets!r}, not two byte offsets")
    if offsets[1] < offsets[0]:
        raise ValueError(f"{name} ends at byte {offsets[1]}, before it starts at {offsets[0]}")
    return offsets[0], offsets[1], Spec(tuple(shape), DTYPES[dtype])


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"its header names {key!r} twice")
        out[key] = value
    return out
