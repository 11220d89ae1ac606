"""Which checkpoint ``resume("latest")`` loads, and what it does with corrupt ones.

Pruning checks sizes only (hashing every checkpoint at every save would cost
too much), so damage that keeps the sizes (a flipped bit) counts as good
there, and a corrupt checkpoint with a higher step than anything a new run
has saved would push that run's checkpoints out, one save after the other.
Resume hashes them: every checkpoint it finds corrupt is renamed
``corrupt-step-N`` (``.1``, ``.2`` ... if taken), named in its warning. No
listing, load or prune looks at that name, and nothing deletes it: what to
do with it is a person's call.

While nothing good is left, a plain ``resume()`` still refuses to start from
step 0 (moved-aside checkpoints included): a run is never thrown away
silently. ``resume(fresh_ok=True)`` moves them aside and starts over.

Runs on the main rank only; the manager broadcasts its answer. The same rules
hold for checkpoints at a URL (:mod:`~manygpu.checkpoint_io.remote_layout`): there
a corrupt step is copied to ``corrupt-step-N`` and deleted (stores have no rename).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from manygpu.checkpoint_io import layout, remote_layout
from manygpu.checkpoint_io.remote import Url
from manygpu.errors import CheckpointError

PREFIX = "corrupt-"
"""Put in front of a corrupt checkpoint's directory name (``corrupt-step-00000006``)."""

Verdict = tuple[str, str]
"""``("ok", path)``, ``("none", "")`` (start from step 0) or ``("error", message)``."""


def moved_aside(root: Path) -> list[Path]:
    """Checkpoints moved aside earlier, by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX + layout.PREFIX))


def move_aside(path: Path) -> Path:
    """Rename the checkpoint ``path`` to ``corrupt-<its name>`` beside it; the new path."""
    target, n = path.with_name(PREFIX + path.name), 0
    while target.exists() or target.is_symlink():  # corrupt before: keep both
        n += 1
        target = path.with_name(f"{PREFIX}{path.name}.{n}")
    os.rename(path, target)
    layout.fsync_path(path.parent)  # the rename survives a crash, like a commit
    return target


class _Disk:
    """The disk's versions of what :mod:`.remote_layout` does at a URL (same names)."""

    committed = staticmethod(layout.committed)
    verify = staticmethod(layout.verify)
    moved_aside = staticmethod(moved_aside)
    move_aside = staticmethod(move_aside)


def _ops(root: Any) -> Any:
    """Listing, verifying and setting aside for ``root``: a store's, or the disk's."""
    return remote_layout if isinstance(root, Url) else _Disk


def choose_latest(root: Path | Url, fresh_ok: bool) -> Verdict:
    """The newest checkpoint under ``root`` that verifies (sizes and checksums).

    Each newer one that does not is moved aside and named in a warning. With
    none that verifies, a fresh start needs ``fresh_ok``; without it the
    answer is an error naming them, and nothing is moved.
    """
    ops = _ops(root)
    found = list(reversed(ops.committed(root)))
    corrupt: list[tuple[Any, CheckpointError]] = []
    chosen = None
    for path in found:
        try:
            chosen = ops.verify(path).path
            break
        except CheckpointError as exc:
            corrupt.append((path, exc))
    if chosen is None and not fresh_ok:
        lost = [p for p, _ in corrupt] + list(reversed(ops.moved_aside(root)))
        for _, damage in corrupt:
            warnings.warn(f"skipping it: {damage}", stacklevel=4)
        if lost:
            names = ", ".join(p.name for p in lost[:5]) + (" ..." if len(lost) > 5 else "")
            return "error", (
                f"every checkpoint in {root} is corrupt ({len(lost)}: {names}); move them "
                "out of it, or call resume(fresh_ok=True) to start from step 0"
            )
    for path, damage in corrupt:
        try:
            target = ops.move_aside(path)
        except OSError as err:
            return "error", (
                f"{damage}; moving it aside failed ({err.strerror or err}): move {path} "
                f"out of {root} by hand"
            )
        warnings.warn(f"skipping it: {damage}; moved it aside to {target.name}", stacklevel=4)
    return ("ok", str(chosen)) if chosen is not None else ("none", "")


def choose(path: Path | Url) -> Verdict:
    """The checkpoint asked for by step or path: it verifies, or the error names why.

    A corrupt one is left where it is (the caller asked for it by name); one
    an earlier resume moved aside is named as such, not as missing.
    """
    ops = _ops(path)
    try:
        return "ok", str(ops.verify(path).path)
    except CheckpointError as exc:
        if path.exists():
            return "error", str(exc)
        aside = [
            p.name
            for p in ops.moved_aside(path.parent)
            if p.name == PREFIX + path.name or p.name.startswith(f"{PREFIX}{path.name}.")
        ]
        if not aside:
            return "error", str(exc)
        return "error", (
            f"checkpoint {path} was found corrupt by an earlier resume and moved aside "
            f"to {', '.join(aside)}"
        )
