"""Checkpoint objects at fsspec URLs (``s3://``, ``gs://``, ``az://``, ``memory://`` ...).

Object stores have no rename, so the commit of :mod:`.layout` (write
``step-N.tmp``, rename it to ``step-N``) cannot be used there. At a URL every
rank writes its objects straight under ``<url>/step-N/``, each hashed while it
streams out (:class:`ObjectFile`: the same checksums :mod:`.writer` computes on
disk), and the main rank writes ``meta.json`` last (:mod:`.remote_layout`):
a step without one is uncommitted and never counted.

Configuration is the store library's own (for S3: the ``AWS_*`` variables,
``AWS_ENDPOINT_URL`` and ``AWS_PROFILE`` included, config files, instance roles)
plus the ``storage_options`` given to the checkpointer, handed to fsspec as
they are. Nothing here prints or logs them.

Retries: the store libraries already retry each request with backoff (for S3,
botocore retries throttling and 5xx answers, s3fs dropped connections and
timeouts; gcsfs and adlfs do the same for theirs). :func:`save` adds a bounded
retry of the whole object on top (:data:`RETRIES` tries, :data:`BACKOFF_S`
doubling): an object whose upload still failed is written again from the state
still in memory. Errors that no retry mends (no permission, no bucket) fail at
once. DCP's shard objects get the libraries' retries only (torch writes them).
"""

from __future__ import annotations

import contextlib
import io
import posixpath
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from manygpu.checkpoint_io.integrity import StreamDigest, hashing_pool
from manygpu.errors import UsageError

EXTRA = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "adl": "azure",
}
"""URL protocol -> the manygpu extra that installs its fsspec backend."""

RETRIES = 3
"""Tries of one object's upload (the store library retries each request within a try)."""
BACKOFF_S = 0.5
"""Wait before the second try; doubled before each later one."""

_PERMANENT = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)


def is_url(location: Any) -> bool:
    """Whether a checkpoint location is a URL (``proto://...``) rather than a local path."""
    return isinstance(location, Url) or (isinstance(location, str) and "://" in location)


@dataclass(frozen=True)
class Url:
    """A location in a store: the fsspec filesystem and the path it names it by.

    Behaves like the few bits of :class:`~pathlib.Path` the checkpoint code uses
    (``/``, ``name``, ``parent``, ``exists()``), so messages read the same.
    """

    fs: Any = field(compare=False, repr=False)
    path: str

    def __truediv__(self, name: str) -> Url:
        return Url(self.fs, posixpath.join(self.path, name))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> Url:
        return Url(self.fs, posixpath.dirname(self.path))

    def exists(self) -> bool:
        self.fs.invalidate_cache(self.path)
        return bool(self.fs.exists(self.path))

    def relative(self, inner: str) -> str:
        """``inner`` (an fsspec path under this one) relative to it."""
        return posixpath.relpath(inner.rstrip("/"), self.path)

    def __str__(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))


def connect(
    url: str, storage_options: dict[str, Any] | None = None, *, what: str = "checkpoint URL"
) -> Url:
    """The store at ``url``; a missing backend or a bad URL is one :class:`UsageError` line
    (starting with ``what``, e.g. ``weights URL``)."""
    import fsspec
    from fsspec.core import url_to_fs
    from fsspec.utils import get_protocol

    protocol = get_protocol(url)
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        extra = EXTRA.get(protocol)
        fix = f"pip install 'manygpu[{extra}]'" if extra else "install its fsspec backend"
        raise UsageError(
            f"{what} {url}: no fsspec backend for {protocol}:// is installed; {fix}"
        ) from None
    except ValueError:
        raise UsageError(
            f"{what} {url}: fsspec knows no protocol {protocol!r}; "
            "give a local directory or a URL such as s3://bucket/prefix"
        ) from None
    try:
        fs, path = url_to_fs(url, **(storage_options or {}))
    except (TypeError, ValueError) as exc:  # an option the backend does not take
        raise UsageError(f"{what} {url}: {_line(exc)}; check storage_options") from None
    return Url(fs, str(path).rstrip("/") or str(path))


def probe(root: Url, rank: int) -> str | None:
    """Write and delete a tiny object under ``root``: ``None``, or what is wrong, in one line.

    Done at construction, before training: wrong credentials, a missing bucket
    or a read-only grant surface here instead of at the first save.
    """
    target = root / f".manygpu-probe-rank{rank}"
    try:
        root.fs.pipe_file(target.path, b"")
        root.fs.rm_file(target.path)
    except Exception as exc:
        return f"cannot write to the checkpoint store {root} ({why(exc)})"
    return None


def why(exc: BaseException) -> str:
    """What a store error says, named: a missing bucket, refused credentials, or its first line."""
    text = _line(exc)
    if isinstance(exc, FileNotFoundError):
        return f"{text}: the bucket or container does not exist; create it or fix the URL"
    if isinstance(exc, PermissionError):
        return f"{text}: the credentials were refused; check AWS_* / the store's config"
    return text


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:240] if text else type(exc).__name__


class ObjectFile:
    """A write-only object that hashes what it writes (:class:`~.writer.DurableFile`'s twin).

    The store library buffers and uploads (s3fs: one part per ``block_size``);
    :meth:`close` finishes the upload. ``fileno`` is unsupported: nothing to fsync.
    """

    def __init__(self, target: Url, pool: ThreadPoolExecutor) -> None:
        self.target = target
        self._fh = target.fs.open(target.path, "wb")
        self._digest = StreamDigest(pool)
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        jobs = self._digest.feed(view)
        try:
            self._fh.write(view)
        finally:
            wait(jobs)  # the buffer may be freed when we return
        for job in jobs:
            job.result()
        return len(view)

    def tell(self) -> int:
        return self._digest.size

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """The store library uploads whole parts; nothing to do between them."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("an object in a store has no file descriptor")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._fh.close()

    def discard(self) -> None:
        """Give up on a failed write: no partial object is left (where the library allows)."""
        self.closed = True
        try:
            discard = getattr(self._fh, "discard", None)
            if discard is not None:
                discard()  # an unfinished multipart upload is aborted, nothing lands
                with contextlib.suppress(Exception):  # and the file's finaliser uploads nothing
                    self._fh.closed = True
            else:
                self._fh.close()
            if self.target.fs.exists(self.target.path):
                self.target.fs.rm_file(self.target.path)
        except Exception:  # the step stays uncommitted either way
            pass

    def entry(self) -> dict[str, Any]:
        """This object's line in ``meta.json``'s file table (after :meth:`close`)."""
        return {"bytes": self._digest.size, "crc32": self._digest.hexdigest()}


def transient(exc: BaseException) -> bool:
    """Whether another try may succeed: store and network errors, not refusals."""
    return isinstance(exc, OSError | ConnectionError | TimeoutError) and not isinstance(
        exc, _PERMANENT
    )


def write_object(
    target: Url,
    fill: Callable[[ObjectFile], None],
    pool: ThreadPoolExecutor,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Write one object by ``fill`` (which may run again), retried; its file-table entry."""
    delay = BACKOFF_S
    for attempt in range(1, RETRIES + 1):
        fh = None
        try:
            fh = ObjectFile(target, pool)
            fill(fh)
            fh.close()
            return fh.entry()
        except BaseException as exc:
            if fh is not None:
                fh.discard()
            if attempt == RETRIES or not transient(exc):
                raise OSError(f"writing {target} failed: {_line(exc)}") from exc
        sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def save(obj: Any, target: Url, pool: ThreadPoolExecutor | None = None) -> dict[str, Any]:
    """``torch.save(obj)`` into the object ``target``, hashed while written; its table entry."""
    from manygpu.checkpoint_io.writer import _torch_save

    if pool is None:
        with hashing_pool() as own:
            return save(obj, target, own)
    return write_object(target, lambda fh: _torch_save(obj, fh), pool)  # type: ignore[arg-type]
