"""The Horovod-style examples under ``manygpu launch``, with only the import line changed.

``train_mnist_style.py`` follows Horovod's PyTorch recipe; each rank draws
different initial weights, so the broadcast from rank 0 is what makes the two
ranks train as one: their result must equal one process on the same global
batch (twice the per-rank batch at the same scaled learning rate); that one
process is forked by the test harness (no torch import of its own).
``synthetic_benchmark.py`` must run and report images per second, under
``manygpu launch`` and plain torchrun, with the CPU-sized model it picks by default. Both are
run by their path, as a multi-host launch (``-H``) would run them.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_harness import JOB_VARIABLES, run_ranks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "horovod"
TOL = 1e-5
"""Same float32 arithmetic in a different order (two half batches, then an average)."""


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env |= {"PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=240, cwd=cwd, env=env
    )


def _mnist_one_process(script: str, args: list[str]) -> None:
    """``python train_mnist_style.py ARGS`` on the two ranks' global batch at the same
    scaled rate: the script run by its path in a process forked by the test harness (no
    torch import of its own), without the harness's job variables, as plain python."""
    for name in (*JOB_VARIABLES, "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    sys.argv = [script, *args, "--batch-size", "64", "--lr", "0.02"]
    runpy.run_path(script, run_name="__main__")


def test_mnist_recipe_on_two_ranks_equals_one_process(tmp_path: Path) -> None:
    script = str(EXAMPLES / "train_mnist_style.py")
    small = ["--epochs", "2", "--train-size", "256", "--test-size", "128"]
    two = _run(
        ["-m", "manygpu", "launch", "--nproc-per-node", "2", script, *small,
         "--save", "two.pt", "--metrics", "two.json"],
        tmp_path,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "Test set: Average loss" in two.stdout
    assert json.loads((tmp_path / "two.json").read_text())["size"] == 2
    run_ranks(_mnist_one_process, 1, script, [*small, "--save", str(tmp_path / "one.pt")])
    got, want = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=0, atol=TOL), name


def test_mnist_recipe_learns_in_its_default_configuration(tmp_path: Path) -> None:
    """Run as a new user would (defaults, two ranks): held-out accuracy far above chance (10%)."""
    script = str(EXAMPLES / "train_mnist_style.py")
    res = _run(
        ["-m", "manygpu", "launch", "--nproc-per-node", "2", script, "--metrics", "m.json"],
        tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["size"] == 2
    assert metrics["accuracy"] > 0.9, res.stdout[-3000:]
    assert metrics["test_loss"] < 1.0, res.stdout[-3000:]


LAUNCHERS = {
    "manygpu": ["-m", "manygpu", "launch", "--nproc-per-node", "2"],
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_synthetic_benchmark_reports_images_per_second(tmp_path: Path, launcher: str) -> None:
    res = _run(
        [*LAUNCHERS[launcher], str(EXAMPLES / "synthetic_benchmark.py"),
         "--num-classes", "10", "--batch-size", "4", "--num-warmup-batches", "1",
         "--num-batches-per-iter", "2", "--num-iters", "2", "--fp16-allreduce",
         "--json", "bench.json"],
        tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Total img/sec on 2 CPU(s)" in res.stdout
    assert "Model: resnet_cnn at 32x32 (the default on a CPU" in res.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["size"] == 2 and len(result["iters"]) == 2
    assert (result["model"], result["image_size"]) == ("resnet_cnn", 32)
    assert result["img_sec_total"] > 0
