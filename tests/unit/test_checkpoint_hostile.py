"""Crafted checkpoints that try to read past their own files, or to drive the terminal.

A DCP ``.metadata`` names the file each tensor lives in; a crafted one (or a
symlink) could make a load read another checkpoint's weights, past the
checksums of ``meta.json``. Every file read must be inside the checkpoint
directory (symlinks resolved) and listed in ``meta.json``; anything else is
damage. And whatever ``checkpoint inspect`` prints from a checkpoint is shown,
never obeyed: escape sequences and rich markup come out as visible text.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_job import build
from ckpt_sign import resign

from manygpu import Parallel
from manygpu.checkpoint import CheckpointError, TrainState
from manygpu.checkpoint.export import export_safetensors, inspect
from manygpu.checkpoint_io import formats
from manygpu.checkpoint_io.safe_dcp import load_metadata


def _two_checkpoints(tmp_path: Path) -> tuple[Parallel, Any, Path, Path]:
    """A victim checkpoint (weights all 7) and the one a crafted load is aimed from."""
    par = Parallel(strategy="single")
    model, _, _, _, ckpt = build(par, tmp_path / "other", every=0, fmt="dcp")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    other = ckpt.save(TrainState(step=1))
    _, _, _, _, ckpt = build(par, tmp_path / "ck", every=0, fmt="dcp")
    return par, ckpt, ckpt.save(TrainState(step=1)), other


def _retarget(step: Path, where: Callable[[str], str]) -> None:
    """Rewrite every shard path in ``.metadata`` with ``where``, and re-sign meta.json."""
    path = step / formats.SHARDS / ".metadata"
    with open(path, "rb") as fh:
        metadata = load_metadata(fh)
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=where(info.relative_path))
        for index, info in metadata.storage_data.items()
    }
    path.write_bytes(pickle.dumps(metadata))
    resign(step)


def _damage(read: Callable[[], Any]) -> str:
    """The one-line damage report of ``read``: raised, or inspect's status."""
    try:
        info = read()
    except CheckpointError as exc:
        return str(exc)
    status = info["status"] if isinstance(info, dict) else f"read it: {info!r}"
    assert status != "ok", "a checkpoint reading files outside itself was called ok"
    return str(status)


def _outside(kind: str, step: Path, other: Path) -> str:
    """Point ``step``'s shard reads at ``other``'s files; the name a report must carry."""
    shards, theirs = step / formats.SHARDS, other / formats.SHARDS
    if kind == "dotdot":
        _retarget(step, lambda rel: f"../../../other/{other.name}/{formats.SHARDS}/{rel}")
    elif kind == "absolute":
        _retarget(step, lambda rel: str(theirs / rel))
    elif kind == "file-symlink":
        for file in shards.glob("*.distcp"):
            file.unlink()
            file.symlink_to(theirs / file.name)
        resign(step)
    else:  # the whole shards directory is a link to the other checkpoint's
        for file in shards.iterdir():
            file.unlink()
        shards.rmdir()
        shards.symlink_to(theirs, target_is_directory=True)
        resign(step)
    return ".metadata" if kind == "dir-symlink" else ".distcp"


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "file-symlink", "dir-symlink"])
def test_shard_reads_outside_the_checkpoint_are_damage(tmp_path: Path, kind: str) -> None:
    par, ckpt, step, other = _two_checkpoints(tmp_path)
    try:
        needle = _outside(kind, step, other)
        out = tmp_path / "w.safetensors"
        for read in (
            lambda: ckpt.resume(1),
            lambda: inspect(step),
            lambda: export_safetensors(step, out),
        ):
            report = _damage(read)
            assert needle in report and "\n" not in report, report
        assert not out.exists()  # the other checkpoint's weights were not exported
    finally:
        par.close()


def test_files_listed_and_inside_still_load(tmp_path: Path) -> None:
    par, ckpt, step, _ = _two_checkpoints(tmp_path)
    try:
        _retarget(step, lambda rel: f"./{rel}")  # harmless spelling of the same file
        assert ckpt.resume(1).step == 1
        assert inspect(step)["status"] == "ok"
    finally:
        par.close()


# -- inspect prints what a checkpoint holds, never what it asks a terminal to do ----
HOSTILE = {
    "strategy": "\x1b]0;pwned title\x07",
    "precision": "[red]boom[/]",
    "created": "2026\r\x1b[2Jcleared",
    "extra": {"note": "[link=file:///etc]x[/link]\x9b31m"},
}


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide console: no table cell is wrapped in the middle of what a test looks for."""
    monkeypatch.setenv("COLUMNS", "1000")


def _hostile_checkpoint(tmp_path: Path) -> Path:
    with Parallel(strategy="single") as par:
        _, _, _, _, ckpt = build(par, tmp_path / "ck", every=0)
        step = ckpt.save(TrainState(step=1))
    (step / "x\x1b[2J[blue]y.bin").write_bytes(b"x")  # a listed file with a hostile name
    resign(step, **HOSTILE)
    return step


def test_inspect_escapes_everything_it_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu.cli.main import main

    step = _hostile_checkpoint(tmp_path)
    assert main(["checkpoint", "inspect", str(step)]) == 0
    out = capsys.readouterr().out
    for raw in ("\x1b", "\x07", "\r", "\x9b"):
        assert raw not in out, f"{raw!r} reached the terminal"
    for shown in ("\\x1b]0;pwned title\\x07", "[red]boom[/]", "\\r\\x1b[2Jcleared", "\\x9b31m"):
        assert shown in out, f"{shown!r} not shown as text"
    assert "[link=file:///etc]x[/link]" in out and "[blue]y.bin" in out


def test_errors_from_a_checkpoint_are_escaped_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu.cli.main import main

    step = _hostile_checkpoint(tmp_path)
    (step / "z\x1b]0;t\x07.bin").write_bytes(b"z")  # unlisted: export names it in its error
    assert main(["checkpoint", "export", str(step), str(tmp_path / "w.st")]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "z\\x1b]0;t\\x07.bin" in err, err
    assert main(["checkpoint", "inspect", str(step)]) == 1  # the status row names it
    out = capsys.readouterr().out
    assert "\x1b" not in out and "z\\x1b]0;t\\x07.bin" in out


def test_inspect_json_is_escaped_by_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu.cli.main import main

    step = _hostile_checkpoint(tmp_path)
    assert main(["checkpoint", "inspect", str(step), "--json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    assert json.loads(out)["strategy"] == HOSTILE["strategy"]  # data, unchanged


def test_a_hostile_directory_name_is_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu.cli.main import main

    root = tmp_path / "d\x1b[2J[red]x"
    with Parallel(strategy="single") as par:
        _, _, _, _, ckpt = build(par, root, every=0)
        ckpt.save(TrainState(step=1))
    assert main(["checkpoint", "inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "d\\x1b[2J[red]x" in out
    assert main(["checkpoint", "export", str(root), str(tmp_path / "w.st")]) == 0
    assert "\x1b" not in capsys.readouterr().out
