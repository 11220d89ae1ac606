"""Step directories at a URL, committed by ``meta.json`` alone (:mod:`.layout`'s twin for stores).

There is no ``.tmp`` and no rename: every rank writes its objects straight under
``<url>/step-N/``, and the main rank writes ``meta.json`` last, after reading
back every object's size from the store (one listing) and checking it against
the file table the ranks sent. A step counts (:func:`committed`, :func:`verify`,
:func:`prune`) only with a valid ``meta.json`` whose sizes match what the store
reports and no object it does not list; one without ``meta.json`` is a save
that never finished, removed by the next save (:func:`remove_stale`) as a stale
``.tmp`` is on disk. A corrupt step is set aside by copying it to
``corrupt-step-N`` and deleting it, ``meta.json`` first, so that it stops
counting before anything else goes (:func:`move_aside`).

The store's listing caches are dropped before each listing: other processes
(the other ranks) write here too.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from manygpu.checkpoint_io import integrity, layout
from manygpu.checkpoint_io.layout import KEY, META, PREFIX, SCHEMA, Found
from manygpu.checkpoint_io.remote import Url
from manygpu.errors import CheckpointError

ASIDE = "corrupt-"
"""Put in front of a corrupt step's name (as :mod:`manygpu.checkpoint.corrupt` does on disk)."""


def objects(where: Url) -> dict[str, int]:
    """Every object under ``where``: its name relative to ``where`` -> its size in bytes."""
    where.fs.invalidate_cache(where.path)
    try:
        found = where.fs.find(where.path, detail=True)
    except FileNotFoundError:
        return {}
    return {
        where.relative(info["name"]): int(info["size"])
        for info in found.values()
        if info.get("type", "file") == "file"
    }


def _by_step(root: Url) -> dict[str, dict[str, int]]:
    """Every ``step-*`` / ``corrupt-step-*`` name under ``root`` -> its objects (one listing)."""
    out: dict[str, dict[str, int]] = {}
    for name, size in objects(root).items():
        top, _, rest = name.partition("/")
        if rest and top.startswith((PREFIX, ASIDE + PREFIX)):
            out.setdefault(top, {})[rest] = size
    return out


def commit(step: Url, meta: dict[str, Any], table: dict[str, dict[str, Any]]) -> None:
    """Write ``meta.json`` last, once every object in ``table`` is in the store with its size.

    An object the table lacks (written by a library through a path we do not
    wrap) is read once and hashed, as :func:`.layout.commit` does on disk.
    """
    present = objects(step)
    present.pop(META, None)
    files = {}
    for name, size in sorted(present.items()):
        entry = table.get(name)
        if entry is None or entry["bytes"] != size:
            entry = {"bytes": size, KEY[SCHEMA]: digest(step / name)}
        files[name] = entry
    missing = sorted(set(table) - set(present))
    if missing:
        raise CheckpointError(
            f"checkpoint {step} is incomplete after writing: the store has no {missing[0]}"
        )
    meta = meta | {"schema": SCHEMA, "checksum": integrity.CHECKSUM, "files": files}
    step.fs.pipe_file((step / META).path, json.dumps(meta, indent=2).encode())


def digest(obj: Url) -> str:
    """An object's schema-2 checksum, read from the store once, segment by segment."""
    crcs = []
    with obj.fs.open(obj.path, "rb") as fh:
        while block := fh.read(integrity.SEGMENT):
            crcs.append(integrity.crc32(block, 0))
    return "".join(f"{c:08x}" for c in crcs)


def read_meta(step: Url) -> dict[str, Any]:
    """``meta.json`` of ``step``, validated (:func:`.layout.check_meta`)."""
    try:
        raw = step.fs.cat_file((step / META).path)
    except FileNotFoundError:
        raise CheckpointError(f"{step} is not a complete checkpoint: {META} is missing") from None
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{step / META} is corrupt: {exc}") from None
    layout.check_meta(meta, step / META)  # type: ignore[arg-type]
    return dict(meta)


def verify(step: Url, *, hashes: bool = True, present: dict[str, int] | None = None) -> Found:
    """Check every listed object is there with its size (and checksum), and no other is.

    ``present`` (name -> size, from one listing of the root) saves a listing per step.
    """
    meta = read_meta(step)
    listed = meta["files"]
    sizes = dict(objects(step) if present is None else present)
    sizes.pop(META, None)
    for name, entry in listed.items():
        if name not in sizes:
            raise CheckpointError(f"checkpoint {step} is incomplete: {name} is missing")
        if sizes[name] != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {step} is corrupt: {name} has {sizes[name]} bytes, "
                f"expected {entry['bytes']}"
            )
    extra = sorted(set(sizes) - set(listed))
    if extra:
        raise CheckpointError(f"checkpoint {step} holds {extra[0]}, which its {META} does not list")
    schema = int(meta.get("schema", 1))
    if hashes:
        if schema != SCHEMA:
            raise CheckpointError(f"checkpoint {step} has schema {schema}; stores hold schema 2")
        for name, entry in listed.items():
            found = digest(step / name)
            if found != entry[KEY[SCHEMA]]:
                start, end = integrity.first_damage(entry[KEY[SCHEMA]], found)
                raise CheckpointError(
                    f"checkpoint {step} is corrupt: {name} fails its CRC-32 check "
                    f"in bytes {start:,}-{min(end, entry['bytes']):,}"
                )
    return Found(step, meta)  # type: ignore[arg-type]


def committed(root: Url) -> list[Url]:
    """Steps under ``root`` that have a ``meta.json`` (not yet verified), oldest first."""
    steps = _by_step(root)
    return [root / n for n in sorted(steps) if n.startswith(PREFIX) and META in steps[n]]


def remove_stale(root: Url) -> list[Url]:
    """Delete step directories without ``meta.json``: saves that never committed."""
    gone = []
    for name, held in sorted(_by_step(root).items()):
        if name.startswith(PREFIX) and META not in held:
            remove(root / name)
            gone.append(root / name)
    return gone


def remove(where: Url) -> None:
    """Delete everything under ``where`` (no error if nothing is there)."""
    where.fs.invalidate_cache(where.path)
    with contextlib.suppress(FileNotFoundError):
        where.fs.rm(where.path, recursive=True)


def prune(root: Url, keep: int) -> list[Url]:
    """Delete good steps older than the newest ``keep`` good ones (sizes checked); returns them.

    As on disk, only steps that verify count towards ``keep``, so the newest
    verified step is never the one removed.
    """
    if keep <= 0:
        return []
    steps = _by_step(root)
    good = []
    for name in sorted(steps):
        if not name.startswith(PREFIX) or META not in steps[name]:
            continue
        try:
            verify(root / name, hashes=False, present=steps[name])
        except CheckpointError:
            continue
        good.append(root / name)
    for old in good[:-keep]:
        remove(old)
    return good[:-keep]


def moved_aside(root: Url) -> list[Url]:
    """Steps set aside earlier, by name."""
    return [root / n for n in sorted(_by_step(root)) if n.startswith(ASIDE)]


def move_aside(step: Url) -> Url:
    """Copy ``step`` to ``corrupt-<its name>`` beside it, then delete it; the new location.

    ``meta.json`` is deleted first: from then on the step no longer counts,
    whatever happens to the rest.
    """
    taken = {u.name for u in moved_aside(step.parent)}
    name, n = ASIDE + step.name, 0
    while name in taken:
        n += 1
        name = f"{ASIDE}{step.name}.{n}"
    target = step.parent / name
    held = objects(step)
    for rel in sorted(held, key=lambda r: r == META):  # meta.json copied last
        step.fs.copy((step / rel).path, (target / rel).path)
    if META in held:
        step.fs.rm_file((step / META).path)
    remove(step)
    return target


def fetch(step: Url, into: Path) -> Path:
    """Download the files ``step``'s ``meta.json`` lists (and it) into ``into``; verified there."""
    meta = read_meta(step)
    for name in [*meta["files"], META]:
        local = layout.inside(into, name)
        local.parent.mkdir(parents=True, exist_ok=True)
        step.fs.get_file((step / name).path, str(local))
    return layout.verify(into).path


def locate(where: Url, step: int | None = None) -> Url:
    """A step at a URL; or under a root, ``step``'s (default: the newest that verifies).

    :func:`.layout.locate`'s twin, with the same messages.
    """
    if META in objects(where):
        if step is not None:
            raise CheckpointError(
                f"{where} is one checkpoint; give the directory holding it to pick one by --step"
            )
        return where
    found = committed(where)
    if step is not None:
        wanted = where / layout.step_dir(Path(), step).name
        if wanted in found:
            return wanted
        steps = [u.name.removeprefix(PREFIX).lstrip("0") or "0" for u in found]
        there = f"it has steps {', '.join(steps)}" if steps else "it holds no checkpoints"
        raise CheckpointError(
            f"no checkpoint of step {step} in {where} ({there}); give one of those"
        )
    for candidate in reversed(found):
        try:
            return verify(candidate).path  # type: ignore[return-value]
        except CheckpointError:
            continue
    raise CheckpointError(f"no complete checkpoint in {where}")


def rows(root: Url, *, hashes: bool = True) -> list[dict[str, Any]]:
    """Every step under ``root`` (one listing): its meta, format, bytes, state and problem."""
    out = []
    for name, held in sorted(_by_step(root).items()):
        meta: dict[str, Any] = {}
        state, problem = "complete", None
        try:
            meta = read_meta(root / name)
            verify(root / name, hashes=hashes, present=held)
        except CheckpointError as exc:
            state, problem = ("corrupt" if meta else "incomplete"), str(exc)
        if META not in held:
            problem = "a save that did not finish (it crashed, or is uploading now)"
        full, dcp = "model.pt" in held, "shards/.metadata" in held
        out.append(
            {
                "name": name,
                "meta": meta,
                "format": "full" if full and not dcp else "dcp" if dcp and not full else None,
                "bytes": sum(held.values()),
                "state": state,
                "moved_aside": name.startswith(ASIDE),
                "problem": problem,
            }
        )
    return out
