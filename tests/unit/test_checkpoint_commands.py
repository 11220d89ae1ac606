"""``manygpu checkpoint inspect|export`` called in-process, on checkpoints of steps 3, 6 and 9.

export: files a user can share (the umask decides, as for any new file),
``--step`` and ``--dtype``. inspect: a directory lists every checkpoint and
its state; numbers are written one way (thousands separators) everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_job import train

from manygpu import Parallel
from manygpu.checkpoint_io import formats, layout
from manygpu.cli.main import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of steps 3, 6 and 9 (shared: tests that damage one copy it first)."""
    root = tmp_path_factory.mktemp("saved") / "ck"
    with Parallel(strategy="single") as par:
        train(par, root, 9, every=3)
    assert [p.name for p in layout.committed(root)] == [f"step-0000000{s}" for s in (3, 6, 9)]
    return root


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide console: no table cell is wrapped in the middle of what a test looks for."""
    monkeypatch.setenv("COLUMNS", "1000")


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _model(root: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(layout.step_dir(root, step) / formats.MODEL, weights_only=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _loaded(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out))


# -- export ---------------------------------------------------------------------------
def test_export_writes_a_file_with_the_umask_s_mode(
    saved: Path, tmp_path: Path, umask: None
) -> None:
    out = tmp_path / "w.safetensors"
    assert main(["checkpoint", "export", str(saved), str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    os.umask(0o077)  # a private umask makes a private file, as it would for any other
    assert main(["checkpoint", "export", str(saved), str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left


def test_export_step_picks_a_checkpoint_newest_by_default(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, step in (([], 9), (["--step", "3"], 3), (["--step", "6"], 6)):
        out = tmp_path / f"{step}.safetensors"
        assert main(["checkpoint", "export", str(saved), str(out), *argv]) == 0
        weights, expected = _loaded(out), _model(saved, step)
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
        assert f"step-0000000{step}" in capsys.readouterr().out
    assert not torch.equal(_loaded(tmp_path / "3.safetensors")["0.weight"], weights["0.weight"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--step", "4"], "no checkpoint of step 4 in"),
        (["--step", "-1"], "not a step number"),
        (["--step", "x"], "not a step number"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_export_bad_step_or_dtype_is_one_line_and_exit_2(
    saved: Path, tmp_path: Path, argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w.safetensors"
    try:
        code = main(["checkpoint", "export", str(saved), str(out), *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and "\n" not in err, err
    assert not out.exists()


def test_export_step_names_the_steps_there_are(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["checkpoint", "export", str(saved), str(tmp_path / "w"), "--step", "4"]) == 2
    assert "it has steps 3, 6, 9" in capsys.readouterr().err


@pytest.mark.parametrize("flag, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_export_dtype_casts_floating_tensors(
    saved: Path, tmp_path: Path, flag: str, dtype: torch.dtype
) -> None:
    out = tmp_path / "w.safetensors"
    assert main(["checkpoint", "export", str(saved), str(out), "--dtype", flag]) == 0
    weights, expected = _loaded(out), _model(saved, 9)
    assert {v.dtype for v in weights.values()} == {dtype}
    assert all(torch.equal(weights[k], expected[k].to(dtype)) for k in expected)


# -- inspect --------------------------------------------------------------------------
def test_inspect_a_directory_lists_every_checkpoint_and_its_state(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    model = layout.step_dir(root, 6) / formats.MODEL
    damaged = bytearray(model.read_bytes())
    damaged[100] ^= 1  # same size: only the checksum sees it
    model.write_bytes(bytes(damaged))
    layout.tmp_dir(root, 12).mkdir()  # a save that never finished
    assert main(["checkpoint", "inspect", str(root), "--json"]) == 1  # not all complete
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["step"], r["state"]) for r in listed] == [
        (3, "complete"),
        (6, "corrupt"),
        (9, "complete"),
        (12, "incomplete"),
    ]
    # 4 samples a step, 48 in an epoch, one rank.
    assert [(r["epoch"], r["sample"], r["world_size"]) for r in listed[:3]] == [
        (0, 12, 1),
        (0, 24, 1),
        (0, 36, 1),
    ]
    assert listed[0]["format"] == "full" and listed[0]["bytes"] > 1000
    assert "model.pt fails its CRC-32 check" in listed[1]["problem"]
    assert main(["checkpoint", "inspect", str(root)]) == 1
    text = capsys.readouterr().out
    for r in listed:
        row = next(line for line in text.splitlines() if line.lstrip().startswith(r["name"]))
        assert row.split()[1] == str(r["step"]) and row.split()[-1] == r["state"], row
    assert f"{listed[0]['bytes']:,}" in text
    assert "step-00000006: checkpoint" in text and "fails its CRC-32 check" in text


def test_inspect_of_a_good_directory_exits_0(
    saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["checkpoint", "inspect", str(saved), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [r["step"] for r in listed] == [3, 6, 9]


def test_inspect_writes_every_number_with_separators(
    saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = layout.step_dir(saved, 9)
    assert main(["checkpoint", "inspect", str(step), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bytes"] >= 1000 and info["sample"] == 36  # big enough to need a separator
    assert main(["checkpoint", "inspect", str(step)]) == 0
    cells = {}
    for line in capsys.readouterr().out.splitlines():
        parts = [p.strip() for p in line.strip("│ ").split("│")]
        if len(parts) == 2:
            cells[parts[0]] = parts[1]
    assert cells["bytes"] == f"{info['bytes']:,} bytes"
    for name, size in info["files"].items():
        assert cells[name] == f"{size:,} bytes"


def test_a_checkpoint_already_moved_aside_does_not_fail_inspect(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume renames a corrupt checkpoint corrupt-step-N: handled, so a health check
    that runs inspect keeps passing while the rest is complete."""
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    step = layout.step_dir(root, 6)
    (step / formats.MODEL).write_bytes(b"garbage")
    step.rename(root / f"corrupt-{step.name}")
    assert main(["checkpoint", "inspect", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [r["moved_aside"] for r in listed].count(True) == 1
