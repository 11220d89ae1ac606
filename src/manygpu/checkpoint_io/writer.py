"""Write a checkpoint file once: hashed as it streams, flushed to disk as it grows.

:class:`DurableFile` is the file object ``torch.save`` (and DCP's writer) write
into. Each buffer it is given is, at the same time, written to the file by the
calling thread and hashed segment by segment on the hashing pool
(:class:`~.integrity.StreamDigest`), so the checksum costs no second pass over
the bytes. A helper thread asks the kernel to write the file's dirty pages out
(``fdatasync``) while serialization goes on, so the final ``fsync`` that makes
the file durable waits only for the tail instead of the whole file.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from manygpu.checkpoint_io.integrity import StreamDigest, hashing_pool

FLUSH_EVERY = 128 << 20
"""Start writing dirty pages out after this many new bytes (overlaps disk and CPU)."""


class DurableFile:
    """A write-only file that hashes what it writes and is fsynced on :meth:`close`.

    Provides what ``torch.save`` and DCP's file writer use: ``write``,
    ``tell``, ``flush``, ``fileno``, ``close``.
    """

    def __init__(self, path: Path, pool: ThreadPoolExecutor) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._digest = StreamDigest(pool)
        self._unflushed = 0
        self._dirty = threading.Event()
        self._stop = False
        self._flush_error: OSError | None = None
        self._flusher = threading.Thread(target=self._flush_loop, name="manygpu-fsync")
        self._flusher.daemon = True  # never keeps a dying process alive
        self._flusher.start()
        self.closed = False

    def _flush_loop(self) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            if self._stop:
                return
            try:
                os.fdatasync(self._fd)
            except OSError as exc:  # reported by close(), on the writing thread
                self._flush_error = exc
                return

    def write(self, data: Any) -> int:
        """Write all of ``data`` while its segments hash on the pool."""
        view = memoryview(data).cast("B")
        jobs = self._digest.feed(view)
        try:
            done = 0
            while done < len(view):
                done += os.write(self._fd, view[done:])
        finally:
            wait(jobs)  # the buffer may be freed when we return
        for job in jobs:
            job.result()
        self._unflushed += len(view)
        if self._unflushed >= FLUSH_EVERY:
            self._unflushed = 0
            self._dirty.set()
        return len(view)

    def tell(self) -> int:
        return self._digest.size

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing is buffered here (every write goes to the kernel at once)."""

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Stop the flusher, fsync, close; raise what the flusher met (a full disk)."""
        if self.closed:
            return
        self.closed = True
        self._stop = True
        self._dirty.set()
        self._flusher.join()
        try:
            if self._flush_error is not None:
                raise self._flush_error
            os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def entry(self) -> dict[str, Any]:
        """This file's line in ``meta.json``'s file table (after :meth:`close`)."""
        return {"bytes": self._digest.size, "crc32": self._digest.hexdigest()}

    def __enter__(self) -> DurableFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _zip_crc_optional() -> bool:
    """Whether torch's zip writer can be driven directly (its CRC-32 pass switched off)."""
    import inspect

    save_fn = getattr(torch.serialization, "_save", None)
    if save_fn is None or not hasattr(torch._C, "PyTorchFileWriter"):
        return False
    wanted = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]
    return list(inspect.signature(save_fn).parameters) == wanted


def _torch_save(obj: Any, fh: DurableFile) -> None:
    """``torch.save(obj, fh)`` without the zip format's own CRC-32 of every record.

    That CRC runs on the writing thread over every byte, and the checksum we
    compute while writing already covers the file; ``torch.load`` does not
    check it (torch's ``set_crc32_options(False)`` writes the same files, but
    is a process-wide switch a library must not flip). Falls back to plain
    ``torch.save`` if torch's internals ever change shape.
    """
    if not _zip_crc_optional():
        torch.save(obj, fh)  # type: ignore[arg-type]
        return
    import pickle

    from torch.serialization import _get_storage_alignment, _save

    zip_file = torch._C.PyTorchFileWriter(fh, False, _get_storage_alignment())  # type: ignore[call-overload]
    try:
        _save(obj, zip_file, pickle, 2, False)
    finally:
        # As torch.save does: finalise even after an error, or the writer's
        # destructor tries again and a second failure (a full disk) aborts.
        zip_file.write_end_of_file()


def save(obj: Any, path: Path, pool: ThreadPoolExecutor | None = None) -> dict[str, Any]:
    """``torch.save(obj, path)``, hashed while written and durable; returns its table entry.

    ``pool`` hashes the segments (one of its own when not given).
    """
    if pool is None:
        with hashing_pool() as own:
            return save(obj, path, own)
    with DurableFile(path, pool) as fh:
        _torch_save(obj, fh)
    return fh.entry()
