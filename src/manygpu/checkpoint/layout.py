"""On-disk layout: ``DIR/step-00000042/`` directories, committed atomically.

A checkpoint is written into ``step-N.tmp``, every file fsynced, then a
``meta.json`` listing every file's size and SHA-256 is written (and fsynced)
last, and the directory is renamed to ``step-N`` (and the parent fsynced). A
crash at any point leaves either the previous checkpoints untouched plus a
``.tmp`` directory that is ignored and cleaned up, or a complete new one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The old home of CheckpointError (now manygpu.errors): kept importable from here.
from manygpu.errors import CheckpointError as CheckpointError

META = "meta.json"
PREFIX = "step-"
TMP_SUFFIX = ".tmp"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}{TMP_SUFFIX}"


def fsync_path(path: Path) -> None:
    """fsync a file or directory (directories make renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_table(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``directory`` (but meta.json) with its size and hash."""
    table = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != META):
        table[str(path.relative_to(directory))] = {
            "bytes": path.stat().st_size,
            "sha256": sha256(path),
        }
    return table


def commit(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """fsync every file, write meta.json last, rename ``tmp`` to ``final``."""
    for path in tmp.rglob("*"):
        if path.is_file():
            fsync_path(path)
    meta = meta | {"schema": SCHEMA, "files": file_table(tmp)}
    meta_path = tmp / META
    with open(meta_path, "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    if final.exists():  # same step saved again: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(final.parent)


@dataclass(frozen=True)
class Found:
    """A committed checkpoint directory and its metadata."""

    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


SCHEMA = 1
"""Version of meta.json's layout; a newer one is refused, not guessed at."""
_SHA256_HEX = frozenset("0123456789abcdef")


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of ``path``, validated (:func:`check_meta`)."""
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {META} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is corrupt: {exc}") from None
    check_meta(meta, meta_path)
    return dict(meta)


def check_meta(meta: Any, where: Path) -> None:
    """Raise :class:`CheckpointError` unless ``meta`` has our schema (a file list included).

    Without a file list nothing could be verified, so it is not a checkpoint.
    """

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where} is not valid checkpoint metadata: {what}")

    if not isinstance(meta, dict):
        raise bad(f"a JSON {type(meta).__name__}, not an object")
    if meta.get("schema", SCHEMA) != SCHEMA:
        raise bad(f"schema {meta.get('schema')!r}; this manygpu reads schema {SCHEMA}")
    for key, low in (("step", 0), ("epoch", 0), ("world_size", 1)):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise bad(f"{key!r} is {value!r}, not an integer >= {low}")
    for key in ("extra", "loader"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise bad(f"{key!r} is not an object")
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise bad("no 'files' table (sizes and SHA-256 of every file)")
    for name, entry in files.items():
        _check_entry(name, entry, bad)


def _check_entry(name: str, entry: Any, bad: Any) -> None:
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts or not parts:
        raise bad(f"file name {name!r} leaves the checkpoint directory")
    if not isinstance(entry, dict):
        raise bad(f"entry of {name!r} is not an object")
    size, digest = entry.get("bytes"), entry.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad(f"size of {name!r} is {size!r}")
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _SHA256_HEX:
        raise bad(f"sha256 of {name!r} is not 64 hex digits")


def verify(path: Path, *, hashes: bool = True) -> Found:
    """Check every listed file exists with its size (and hash), and no other file is there."""
    meta = read_meta(path)
    listed = meta["files"]
    for name, entry in listed.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {size} bytes, expected {entry['bytes']}"
            )
        if hashes and sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} fails its SHA-256 check")
    for file in path.rglob("*"):
        name = str(file.relative_to(path))
        if file.is_file() and name != META and name not in listed:
            raise CheckpointError(f"checkpoint {path} holds {name}, which its {META} does not list")
    return Found(path, meta)


def committed(root: Path) -> list[Path]:
    """Committed checkpoint directories, oldest first (by step)."""
    if not root.is_dir():
        return []
    dirs = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(TMP_SUFFIX)
    ]
    return sorted(dirs, key=lambda p: p.name)


def remove_stale(root: Path) -> list[Path]:
    """Delete ``.tmp`` directories left by a save that crashed."""
    gone = []
    for stale in root.glob(f"{PREFIX}*{TMP_SUFFIX}"):
        shutil.rmtree(stale, ignore_errors=True)
        gone.append(stale)
    return gone


def prune(root: Path, keep: int) -> list[Path]:
    """Delete good checkpoints older than the newest ``keep`` good ones; returns them.

    Only checkpoints that verify (sizes; hashing every file at every save
    would cost too much) count towards ``keep``, so a run of corrupt ones
    can never push the newest good checkpoint out. Corrupt ones are left
    for a person to look at: resume names them.
    """
    if keep <= 0:
        return []
    good = []
    for path in committed(root):
        try:
            verify(path, hashes=False)
        except CheckpointError:
            continue
        good.append(path)
    gone = []
    for old in good[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
        gone.append(old)
    return gone


def _tensor_bytes(tree: Any) -> int:
    if hasattr(tree, "element_size") and hasattr(tree, "numel"):
        return int(tree.numel() * tree.element_size())
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def write_failure(exc: BaseException, tmp: Path, files: Any = None) -> str:
    """What went wrong writing into ``tmp``, in words: a full disk is named as one.

    torch's writer reports a full disk as "unexpected pos N vs M" (no errno),
    so the free space left decides: if it is smaller than what this save
    writes, the disk is full.
    """
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    needed = _tensor_bytes(files)
    try:
        free = shutil.disk_usage(tmp if tmp.exists() else tmp.parent).free
    except OSError:
        return text
    full = getattr(exc, "errno", None) == errno.ENOSPC or "unexpected pos" in text
    if full or (needed and free < needed):
        mib = 2**20
        need = f"; this checkpoint needs about {needed / mib:.1f} MiB" if needed else ""
        return (
            f"no space left on the device holding {tmp.parent} ({free / mib:.1f} MiB free"
            f"{need}); free some space or give the Checkpointer another directory"
        )
    return text
