"""On-disk layout: ``DIR/step-00000042/`` directories, committed atomically.

A checkpoint is written into ``step-N.tmp``, every file fsynced, then a
``meta.json`` listing every file's size and checksum is written (and fsynced)
last, and the directory is renamed to ``step-N`` (and the parent fsynced). A
crash at any point leaves either the previous checkpoints untouched plus a
``.tmp`` directory that is ignored and cleaned up, or a complete new one.

The checksums are computed while the files are written (:mod:`.writer`) and
handed to :func:`commit`; nothing is read back to hash it. Schema 2 lists
a CRC-32 per 16 MiB segment (:mod:`.integrity`); schema 1 checkpoints (a plain
SHA-256 per file) still verify and load.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manygpu.checkpoint_io import integrity

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


def data_files(directory: Path) -> list[Path]:
    """Every file of a step directory but its meta.json, in a stable order."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != META)


def file_entry(path: Path) -> dict[str, Any]:
    """``path``'s meta.json entry: its size and its checksum (read once, in segments)."""
    with integrity.hashing_pool() as pool:
        return {"bytes": path.stat().st_size, KEY[SCHEMA]: integrity.file_digest(path, pool)}


def _complete_table(tmp: Path, table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``table`` checked against the files in ``tmp`` (sizes); files it lacks are hashed.

    Every file we write comes with its entry; one without (written by a
    library through a path we do not wrap) is read once here rather than left
    unverified.
    """
    present = {str(p.relative_to(tmp)): p for p in data_files(tmp)}
    out = {}
    for name, path in present.items():
        entry = table.get(name)
        if entry is None or entry["bytes"] != path.stat().st_size:
            fsync_path(path)
            entry = file_entry(path)
        out[name] = entry
    return out


def commit(
    tmp: Path, final: Path, meta: dict[str, Any], table: dict[str, dict[str, Any]] | None = None
) -> None:
    """Write meta.json last (with the file table) and rename ``tmp`` to ``final``.

    The files in ``table`` were fsynced by their writers; here the directories
    holding them are, so their names survive a power cut too.
    """
    files = _complete_table(tmp, table or {})
    for directory in {tmp, *(p.parent for p in tmp.rglob("*") if p.is_file())}:
        fsync_path(directory)
    meta = meta | {"schema": SCHEMA, "checksum": integrity.CHECKSUM, "files": files}
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


SCHEMA = 2
"""Version of meta.json's layout; a newer one is refused, not guessed at.

1: a plain SHA-256 per file. 2: a CRC-32 per segment (:mod:`.integrity`), named
by the ``checksum`` field. Both are read."""
READABLE = (1, 2)
KEY = {1: "sha256", 2: "crc32"}
"""The file-table key holding a file's checksum, per schema."""
_NAME = {1: "SHA-256", 2: "CRC-32"}
_HEX = frozenset("0123456789abcdef")


def inside(path: Path, name: str) -> Path:
    """``path / name``, unless that leads outside the checkpoint ``path`` once links resolve.

    ``meta.json`` vouches for the bytes of the files it lists; a symlink among
    them (or a linked directory on the way) would have a load read another
    checkpoint's files, whose checksums match because they are its own.
    """
    file = path / name
    real = file.resolve()
    if not real.is_relative_to(path.resolve()):
        raise CheckpointError(
            f"checkpoint {path} is damaged: {name} leads outside it (to {real}); "
            "every file must be inside the checkpoint directory"
        )
    return file


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of ``path``, validated (:func:`check_meta`)."""
    meta_path = inside(path, META)
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
    schema = meta.get("schema", 1)
    if isinstance(schema, bool) or schema not in READABLE:
        raise bad(f"schema {schema!r}; this manygpu reads schema 1 and 2")
    if schema == 2 and meta.get("checksum") != integrity.CHECKSUM:
        raise bad(f"checksum {meta.get('checksum')!r}; schema 2 uses {integrity.CHECKSUM!r}")
    for key, low in (("step", 0), ("epoch", 0), ("world_size", 1)):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise bad(f"{key!r} is {value!r}, not an integer >= {low}")
    for key in ("extra", "loader"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise bad(f"{key!r} is not an object")
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise bad("no 'files' table (sizes and checksums of every file)")
    for name, entry in files.items():
        _check_entry(name, entry, bad, schema)


def _check_entry(name: str, entry: Any, bad: Any, schema: int) -> None:
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts or not parts:
        raise bad(f"file name {name!r} leaves the checkpoint directory")
    if not isinstance(entry, dict):
        raise bad(f"entry of {name!r} is not an object")
    key = KEY[schema]
    size, digest = entry.get("bytes"), entry.get(key)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad(f"size of {name!r} is {size!r}")
    if schema == 1:
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
            raise bad(f"sha256 of {name!r} is not 64 hex digits")
        return
    segments = -(-size // integrity.SEGMENT)
    if (
        not isinstance(digest, str)
        or len(digest) != segments * integrity.HEX
        or not set(digest) <= _HEX
    ):
        raise bad(f"{key} of {name!r} is not {segments * integrity.HEX} hex digits")


def verify(path: Path, *, hashes: bool = True) -> Found:
    """Check every listed file is inside ``path`` (links resolved) and exists with its size
    (and hash), and no other file is there."""
    meta = read_meta(path)
    listed = meta["files"]
    for name, entry in listed.items():
        file = inside(path, name)
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {size} bytes, expected {entry['bytes']}"
            )
    for file in path.rglob("*"):
        name = str(file.relative_to(path))
        if file.is_file() and name != META and name not in listed:
            raise CheckpointError(f"checkpoint {path} holds {name}, which its {META} does not list")
    if hashes:
        _check_hashes(path, listed, int(meta.get("schema", 1)))
    return Found(path, meta)


def _check_hashes(path: Path, listed: dict[str, Any], schema: int) -> None:
    # Sizes first (cheap), then the checksums, computed on every core.
    with integrity.hashing_pool(every_core=True) as pool:
        for name, entry in listed.items():
            found = integrity.file_digest(path / name, pool, schema=schema)
            if found == entry[KEY[schema]]:
                continue
            where = ""
            if schema == 2:
                start, end = integrity.first_damage(entry[KEY[schema]], found)
                where = f" in bytes {start:,}-{min(end, entry['bytes']):,}"
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} fails its {_NAME[schema]} check{where}"
            )


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


def locate(path: Path, step: int | None = None, *, hashes: bool = True) -> Path:
    """A step directory; or under a checkpoint root, ``step``'s (default: the newest good one).

    ``hashes=False`` judges "good" by the file table and sizes alone: a rank that
    reads only its slices of the weights should not read every byte to pick one.
    """
    if (path / META).is_file():
        if step is not None:
            raise CheckpointError(
                f"{path} is one checkpoint; give the directory holding it to pick one by --step"
            )
        return path
    if step is not None:
        return _by_step(path, step)
    for candidate in reversed(committed(path)):
        try:
            return verify(candidate, hashes=hashes).path
        except CheckpointError:
            continue
    raise CheckpointError(f"no complete checkpoint in {path}")


def _by_step(root: Path, step: int) -> Path:
    """Step ``step``'s checkpoint under ``root``; the error lists the steps there are."""
    wanted = step_dir(root, step)
    if wanted.is_dir():
        return wanted
    steps = [p.name.removeprefix(PREFIX).lstrip("0") or "0" for p in committed(root)]
    there = f"it has steps {', '.join(steps)}" if steps else "it holds no checkpoints"
    raise CheckpointError(f"no checkpoint of step {step} in {root} ({there}); give one of those")


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
    can never push the newest good checkpoint out. Damage that keeps the
    sizes (a flipped bit) only a resume sees: it moves those checkpoints
    aside (:mod:`.corrupt`), where nothing here counts or deletes them.
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
