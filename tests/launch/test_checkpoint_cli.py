"""manygpu checkpoint inspect / export as a user runs them: a fresh process each, where the
process's own output is the point (the README's export, the one-line refusals); the JSON
of inspect is read in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_job import train
from ckpt_sign import resign
from safetensors import safe_open
from torch import nn

from manygpu import Parallel
from manygpu.checkpoint import Checkpointer, TrainState
from manygpu.cli.main import main


def _run(directory: Path, total: int, every: int) -> None:
    with Parallel(strategy="single") as par:
        train(par, directory, total, every)


class _TiedHead(nn.Module):
    """A language model's shape: the head's weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _save_tied(directory: Path) -> None:
    with Parallel(strategy="single") as par:
        model = par.prepare(_TiedHead())
        Checkpointer(par, directory, model=model, format="dcp").save(TrainState(step=1))


def test_cli_inspect_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "ck", 3, every=3)
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(tmp_path / "ck"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"][-1]["step"] == 3
    cli = [sys.executable, "-m", "manygpu", "checkpoint"]
    # The README's export command on a model with a tied head (a DCP checkpoint stores
    # the tensor under both names): one copy written, the alias recorded as HF does.
    _save_tied(tmp_path / "tied")
    out = tmp_path / "m.safetensors"
    res = subprocess.run(
        [*cli, "export", str(tmp_path / "tied"), str(out)], capture_output=True, text=True
    )
    assert res.returncode == 0 and out.is_file() and "3 tensors" in res.stdout, res.stderr
    assert "tied: head.weight is embed.weight" in res.stdout
    with safe_open(str(out), framework="pt") as handle:
        assert set(handle.keys()) == {"embed.weight", "body.weight", "body.bias"}
        assert handle.metadata()["head.weight"] == "embed.weight"
    # A missing checkpoint (one line, exit 2) is among the CLI's bad input in
    # tests/unit/test_bad_input.py, checked in-process.


class _Evil:
    """Unpickling this would run a shell command that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_cli_refuses_a_malicious_model_pt_in_one_line(tmp_path: Path) -> None:
    from manygpu.checkpoint_io import formats, layout

    _run(tmp_path / "ck", 3, every=3)
    step = layout.step_dir(tmp_path / "ck", 3)
    marker = tmp_path / "pwned"
    torch.save({"weight": _Evil(marker)}, step / formats.MODEL)
    resign(step)  # only the loader's own safety can stop it
    cli = [sys.executable, "-m", "manygpu", "checkpoint"]
    for args in (["inspect", str(step)], ["export", str(step), str(tmp_path / "w.st")]):
        res = subprocess.run([*cli, *args], capture_output=True, text=True)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr
        assert lines[0].startswith("manygpu") and "model.pt" in lines[0], lines[0]
        assert not marker.exists()
    assert not (tmp_path / "w.st").exists()
