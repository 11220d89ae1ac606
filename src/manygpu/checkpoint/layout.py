"""On-disk layout: ``DIR/step-00000042/`` directories, committed atomically.

A checkpoint is written into ``step-N.tmp``, every file fsynced, then a
``meta.json`` listing every file's size and SHA-256 is written (and fsynced)
last, and the directory is renamed to ``step-N`` (and the parent fsynced). A
crash at any point leaves either the previous checkpoints untouched plus a
``.tmp`` directory that is ignored and cleaned up, or a complete new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manygpu.errors import CheckpointError as CheckpointError  # re-exported

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
    meta = meta | {"files": file_table(tmp)}
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


def read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {META} is missing")
    try:
        return dict(json.loads(meta_path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is corrupt: {exc}") from None


def verify(path: Path, *, hashes: bool = True) -> Found:
    """Check every listed file exists with its size (and hash); raise naming the bad one."""
    meta = read_meta(path)
    for name, entry in meta.get("files", {}).items():
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
    """Delete all but the newest ``keep`` checkpoints; returns what was deleted."""
    gone = []
    for old in committed(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
        gone.append(old)
    return gone
