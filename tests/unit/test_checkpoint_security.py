"""A crafted checkpoint directory never runs code: resume, inspect and export.

Each attack plants a pickle whose unpickling would create a marker file, and
re-signs ``meta.json`` (sizes and SHA-256) so that only the loaders' own
safety can stop it. Passing means: a one-line CheckpointError, no marker.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_job import build
from ckpt_sign import resign

from manygpu import Parallel
from manygpu.checkpoint import CheckpointError, TrainState
from manygpu.checkpoint.export import export_safetensors, inspect
from manygpu.checkpoint_io import formats, layout


class _Evil:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _saved(tmp_path: Path, fmt: str) -> tuple[Parallel, Any, Path]:
    par = Parallel(strategy="single")
    _, _, _, _, ckpt = build(par, tmp_path / "ck", every=0, fmt=fmt)
    return par, ckpt, ckpt.save(TrainState(step=1))


def _every_reader(ckpt: Any, step: Path, tmp_path: Path) -> list[str]:
    """Resume, inspect and export the checkpoint; each must refuse it."""
    errors = []
    for read in (
        lambda: ckpt.resume(1),
        lambda: inspect(step),
        lambda: export_safetensors(step, tmp_path / "w.safetensors"),
    ):
        with pytest.raises(CheckpointError) as info:
            read()
        errors.append(str(info.value))
    return errors


@pytest.mark.parametrize(
    "fmt, meta_format, needle",
    [
        ("dcp", None, "system"),  # a crafted .metadata: the allow-list names the global
        ("full", "dcp", "both model.pt and shards/"),  # meta.json cannot pick the reader
    ],
)
def test_crafted_dcp_metadata_is_refused(
    tmp_path: Path, fmt: str, meta_format: str | None, needle: str
) -> None:
    marker = tmp_path / "pwned"
    par, ckpt, step = _saved(tmp_path, fmt)
    try:
        (step / formats.SHARDS).mkdir(exist_ok=True)
        (step / formats.SHARDS / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
        resign(step, **({"format": meta_format} if meta_format else {}))
        for error in _every_reader(ckpt, step, tmp_path):
            assert needle in error, error
        assert not marker.exists()
    finally:
        par.close()


def test_crafted_dcp_bytes_item_is_refused(tmp_path: Path) -> None:
    """Non-tensor items (optimizer hyper-parameters) load weights-only; an export reads
    the model's tensors alone, so it never reaches the item."""
    marker = tmp_path / "pwned"
    par, ckpt, step = _saved(tmp_path, "dcp")
    try:
        state = formats._dcp_state(ckpt.parts)
        groups = state["optim"]["param_groups"]
        groups[0]["lr"] = _Evil(marker)  # a key every resume asks for
        dcp.save(state, checkpoint_id=str(step / formats.SHARDS), no_dist=True)
        resign(step)
        for read in (lambda: ckpt.resume(1), lambda: inspect(step)):
            with pytest.raises(CheckpointError, match="not plain data"):
                read()
        assert export_safetensors(step, tmp_path / "w.safetensors")["tensors"] == 4
        assert not marker.exists()
    finally:
        par.close()


def test_a_clean_dcp_checkpoint_still_loads_through_the_safe_reader(tmp_path: Path) -> None:
    par, ckpt, step = _saved(tmp_path, "dcp")
    try:
        assert ckpt.resume(1).step == 1
        assert inspect(step)["format"] == "dcp"
        summary = export_safetensors(step, tmp_path / "w.safetensors")
        assert summary["tensors"] == 4
    finally:
        par.close()


@pytest.mark.parametrize(
    "module, name", [("builtins", "eval"), ("torch", "load"), ("os", "system")]
)
def test_metadata_unpickler_allows_only_dcp_records(module: str, name: str) -> None:
    from manygpu.checkpoint_io.safe_dcp import load_metadata

    payload = f"c{module}\n{name}\n(S'1'\ntR.".encode()
    with pytest.raises(CheckpointError, match=f"{module}.{name}"):
        load_metadata(io.BytesIO(payload))
    with pytest.raises(CheckpointError, match="not DCP Metadata"):
        load_metadata(io.BytesIO(pickle.dumps(torch.Size([1]))))


def _corrupt(step: Path) -> None:
    model = step / formats.MODEL
    model.write_bytes(model.read_bytes()[:-10])


def test_all_corrupt_directory_refuses_a_silent_fresh_start_and_keeps_new_saves(
    tmp_path: Path,
) -> None:
    par = Parallel(strategy="single")
    try:
        _, _, _, _, ckpt = build(par, tmp_path / "ck", every=0)
        ckpt.keep = 2
        for step in (1, 2, 3):
            _corrupt(ckpt.save(TrainState(step=step)))
        with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="every checkpoint"):
            ckpt.resume()
        with pytest.warns(UserWarning):
            assert ckpt.resume(fresh_ok=True).step == 0
        for step in (4, 5, 6):  # the good ones count; the corrupt ones never push them out
            ckpt.save(TrainState(step=step))
        names = [p.name for p in layout.committed(tmp_path / "ck")]
        assert names[-2:] == ["step-00000005", "step-00000006"]
        assert "step-00000004" not in names
        assert ckpt.resume().step == 6
    finally:
        par.close()


@pytest.mark.parametrize(
    "meta, needle",
    [
        ([], "a JSON list"),
        ({"step": 1, "epoch": 0, "world_size": 1}, "no 'files' table"),
        ({"step": 1, "epoch": 0, "world_size": 1, "files": {}}, "no 'files' table"),
        ({"step": "1", "epoch": 0, "world_size": 1, "files": {"x": {}}}, "'step'"),
        ({"step": 1, "world_size": 1, "files": {"x": {}}}, "'epoch'"),
        ({"step": 1, "epoch": 0, "world_size": 0, "files": {"x": {}}}, "'world_size'"),
        ({"step": 1, "epoch": 0, "world_size": 1, "files": {"../x": {}}}, "leaves the"),
        ({"step": 1, "epoch": 0, "world_size": 1, "files": {"x": {"bytes": -1}}}, "size of"),
        (
            {"step": 1, "epoch": 0, "world_size": 1, "files": {"x": {"bytes": 1, "sha256": "z"}}},
            "sha256",
        ),
        ({"schema": 99, "step": 1, "epoch": 0, "world_size": 1, "files": {}}, "schema 99"),
        ({"step": 1, "epoch": 0, "world_size": 1, "extra": [1], "files": {"x": {}}}, "'extra'"),
    ],
)
def test_malformed_meta_json_is_damage_not_a_crash(tmp_path: Path, meta: Any, needle: str) -> None:
    par = Parallel(strategy="single")
    try:
        _, _, _, _, ckpt = build(par, tmp_path / "ck", every=0)
        ckpt.save(TrainState(step=1))
        bad = ckpt.save(TrainState(step=2))
        (bad / layout.META).write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=needle):
            ckpt.resume(2)
        with pytest.warns(UserWarning, match=needle):
            assert ckpt.resume("latest").step == 1  # skipped like any other damage
    finally:
        par.close()


def test_an_unlisted_file_makes_a_checkpoint_invalid(tmp_path: Path) -> None:
    par, ckpt, step = _saved(tmp_path, "full")
    try:
        (step / "planted.pt").write_bytes(b"x")
        with pytest.raises(CheckpointError, match=r"planted\.pt, which its meta\.json"):
            ckpt.resume(1)
    finally:
        par.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 256 KiB tmpfs (root only; skipped where mounting is not allowed)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_named_and_the_partial_save_removed(small_disk: Path) -> None:
    par = Parallel(strategy="single")
    try:
        model = torch.nn.Linear(256, 512)  # 0.5 MiB of weights: more than the disk
        from manygpu.checkpoint import Checkpointer

        ckpt = Checkpointer(par, small_disk / "ck", model=par.prepare(model), every=0)
        with pytest.raises(CheckpointError, match="no space left on the device") as info:
            ckpt.save(TrainState(step=1))
        assert "MiB free" in str(info.value) and "needs about 0.5 MiB" in str(info.value)
        assert list((small_disk / "ck").glob("*.tmp")) == []
    finally:
        par.close()
