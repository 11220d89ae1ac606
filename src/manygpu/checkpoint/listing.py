"""Every checkpoint under a directory, and the state each is in.

``manygpu checkpoint inspect DIR`` shows them all, not only the newest: which
steps there are to resume or export from, which are damaged, what a crash
left half-written and what a resume moved aside. Each is verified as a
resume would (sizes and checksums); nothing is loaded.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from manygpu.checkpoint import corrupt
from manygpu.checkpoint.export import sample_of
from manygpu.checkpoint_io import formats, layout, remote_layout
from manygpu.checkpoint_io.remote import Url
from manygpu.errors import CheckpointError

COMPLETE, CORRUPT, INCOMPLETE = "complete", "corrupt", "incomplete"
"""A row's ``state``: verifies; fails a check; a save that never committed (or lost its
``meta.json``)."""


def candidates(root: Path) -> list[Path]:
    """Every checkpoint-like directory under ``root``: committed, half-written, moved aside."""
    if not root.is_dir():
        return []
    prefixes = (layout.PREFIX, corrupt.PREFIX + layout.PREFIX)
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefixes)),
        key=lambda p: (_step_in(p.name) or 0, p.name),
    )


def list_checkpoints(root: Path | Url, *, hashes: bool = True) -> list[dict[str, Any]]:
    """One row per directory of :func:`candidates`, oldest step first (or per step at a URL)."""
    if isinstance(root, Url):
        return _remote_rows(root, hashes=hashes)
    return [row(path, hashes=hashes) for path in candidates(root)]


def _remote_rows(root: Url, *, hashes: bool) -> list[dict[str, Any]]:
    """The rows of the steps in a store, in :func:`row`'s shape."""
    out = []
    for found in remote_layout.rows(root, hashes=hashes):
        meta = found.pop("meta")
        out.append(
            {
                "name": found["name"],
                "step": meta.get("step", _step_in(found["name"])),
                "epoch": meta.get("epoch"),
                "sample": sample_of(meta),
                "world_size": meta.get("world_size"),
                **found,
            }
        )
    return sorted(out, key=lambda r: (r["step"] or 0, r["name"]))


def row(path: Path, *, hashes: bool = True) -> dict[str, Any]:
    """A checkpoint's step, position, world size, format, size on disk and state."""
    meta: dict[str, Any] = {}
    state, problem = COMPLETE, None
    try:
        meta = layout.read_meta(path)
        layout.verify(path, hashes=hashes)
    except CheckpointError as exc:
        state, problem = (CORRUPT if meta else INCOMPLETE), str(exc)
    if path.name.endswith(layout.TMP_SUFFIX):
        state, problem = INCOMPLETE, "a save that did not finish (it crashed, or is writing now)"
    return {
        "name": path.name,
        "step": meta.get("step", _step_in(path.name)),
        "epoch": meta.get("epoch"),
        "sample": sample_of(meta),
        "world_size": meta.get("world_size"),
        "format": _format(path),
        "bytes": _bytes(path),
        "state": state,
        "moved_aside": path.name.startswith(corrupt.PREFIX),
        "problem": problem,
    }


def _bytes(path: Path) -> int:
    """Bytes on disk; a file renamed or pruned while we look (a live run) counts 0."""
    total = 0
    try:
        for p in path.rglob("*"):
            with contextlib.suppress(OSError):
                total += p.stat().st_size if p.is_file() else 0
    except OSError:  # the directory itself went (a save renamed, an old one pruned)
        pass
    return total


def _format(path: Path) -> str | None:
    try:
        return formats.detect(path)
    except CheckpointError:
        return None


def _step_in(name: str) -> int | None:
    """The step in a directory's name (``corrupt-step-00000006.1`` -> 6), if it has one."""
    digits = name.removeprefix(corrupt.PREFIX).removeprefix(layout.PREFIX).split(".")[0]
    return int(digits) if digits.isdigit() else None
