"""manygpu checkpoint inspect / export as a user runs them: a fresh process each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ckpt_job import train

from manygpu import Parallel


def _run(directory: Path, total: int, every: int) -> None:
    with Parallel(strategy="single") as par:
        train(par, directory, total, every)


def test_cli_inspect_and_export(tmp_path: Path) -> None:
    _run(tmp_path / "ck", 3, every=3)
    cli = [sys.executable, "-m", "manygpu", "checkpoint"]
    res = subprocess.run(
        [*cli, "inspect", str(tmp_path / "ck"), "--json"], capture_output=True, text=True
    )
    assert res.returncode == 0 and json.loads(res.stdout)["step"] == 3
    out = tmp_path / "m.safetensors"
    res = subprocess.run(
        [*cli, "export", str(tmp_path / "ck"), str(out)], capture_output=True, text=True
    )
    assert res.returncode == 0 and out.is_file() and "4 tensors" in res.stdout
    # A missing checkpoint (one line, exit 2) is among the CLI's bad input in
    # tests/unit/test_bad_input.py, checked in-process.
