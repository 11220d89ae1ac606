"""bench train: the scaling arithmetic, the views, bad input, and one real 1 -> 2 process run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import ROOT, subprocess_env

from manygpu.bench import mfu, models, train_report
from manygpu.bench.train import RunStats, TrainBenchConfig
from manygpu.cli.bench_train import parse_workers
from manygpu.cli.main import main
from manygpu.errors import UsageError


def _run(workers: int, samples_per_s: float) -> RunStats:
    return RunStats(
        model="m", parameters=10, strategy="ddp", workers=workers, nodes=1, device="cpu",
        threads_per_worker=1, precision="fp32", batch_per_worker=8, steps=4,
        samples_per_s=samples_per_s, step_s=0.1, compute_s=0.08, comm_s=0.015, data_s=0.005,
        flops_per_step=10**9, peak_tflops=None, mfu=None,
    )  # fmt: skip


def test_speedup_and_efficiency_against_the_smallest_count(tmp_path: Path) -> None:
    rows = train_report.scaling([_run(4, 350.0), _run(1, 100.0), _run(2, 190.0)])
    assert [r.run.workers for r in rows] == [1, 2, 4]
    assert [r.speedup for r in rows] == pytest.approx([1.0, 1.9, 3.5])
    assert [r.efficiency for r in rows] == pytest.approx([1.0, 0.95, 0.875])
    md = train_report.markdown(rows)
    assert "| 2 | 190.0 | 1.90x | 95.0% |" in md and "n/a" in md
    png = tmp_path / "p.png"
    train_report.plot(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert train_report.scaling([_run(2, 100.0), _run(4, 150.0)])[1].efficiency == 0.75


def test_worker_counts() -> None:
    assert parse_workers("", 0) == [1, 2]
    assert parse_workers("", 8) == [1, 2, 4, 8] and parse_workers("", 6) == [1, 2, 4, 6]
    assert parse_workers("4,1,2", 0) == [1, 2, 4]
    for bad, needle in (("0", ">= 1"), ("2,2", "repeats"), ("one", "integers"), ("", "")):
        if bad:
            with pytest.raises(UsageError, match=needle):
                parse_workers(bad, 0)
    with pytest.raises(UsageError, match="only 2 GPU"):
        parse_workers("1,4", 2)


@pytest.mark.parametrize("name", sorted(models.BUILTINS))
def test_builtin_workloads_train(name: str) -> None:
    w = models.build(name)
    x, y = w.make_batch(2, torch.Generator().manual_seed(0))
    w.loss(w.model(x), y).backward()
    assert w.parameters > 0 and w.name == name


def test_model_specs_and_config() -> None:
    with pytest.raises(UsageError, match="unknown model"):
        models.resolve("resnet9000")
    with pytest.raises(UsageError, match="cannot import"):
        models.resolve("no_such_module_xyz:make")
    with pytest.raises(UsageError, match="has no function"):
        models.resolve("os.path:no_such_function")
    with pytest.raises(UsageError, match="returned a str"):
        models.build("os:getcwd")
    with pytest.raises(UsageError, match="batch"):
        TrainBenchConfig(batch=0)
    with pytest.raises(UsageError, match="precision"):
        TrainBenchConfig(precision="fp8")


def test_peaks_and_mfu() -> None:
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert mfu.peak_tflops("Tesla V100-SXM2-16GB", "fp16") == 125.0
    assert mfu.peak_tflops("cpu", "fp32") is None
    assert mfu.mfu(10**12, 2.0, 4.0) == pytest.approx(0.5)
    assert mfu.mfu(10**12, 2.0, None) is None


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--model", "no_such_module_xyz:f"], "cannot import module"),
        (["--model", "resnet", "--workers", "0,1"], "must be >= 1"),
        (["--model", "resnet", "--workers", "1,x"], "comma list of integers"),
        (["--model", "resnet", "--nproc-per-node", "2"], "use --workers"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_plan_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--cluster", "tpu9", "--params", "1e6"]) == 2
    assert "unknown cluster 'tpu9'" in capsys.readouterr().err
    assert main(["plan", "--cluster", "h100"]) == 2
    assert "--model or --params" in capsys.readouterr().err


@pytest.mark.slow
def test_real_run_one_then_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "manygpu", "bench", "train", "--model", "demo-cnn",
           "--workers", "1,2", "--batch", "8", "--steps", "4", "--warmup", "1", "--block", "2",
           "--json", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                         env=subprocess_env() | {"CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    one, two = data["rows"]
    assert (one["workers"], two["workers"]) == (1, 2)
    for row in (one, two):
        assert row["samples_per_s"] > 0
        assert row["flops_per_step"] > 0 and row["mfu"] is None
        assert row["step_s"] >= row["compute_s"] > 0 and row["comm_s"] >= 0
    # Per-worker scaling: the same CPU threads per worker at every count.
    assert one["threads_per_worker"] == two["threads_per_worker"] >= 1
    assert one["comm_s"] == 0.0 and two["strategy"] == "ddp"
    speedup = two["samples_per_s"] / one["samples_per_s"]
    assert two["speedup"] == pytest.approx(speedup) and two["efficiency"] == pytest.approx(
        speedup / 2
    )
    table_rows = [
        ln for ln in out.with_suffix(".md").read_text().splitlines() if ln[:3] in ("| 1", "| 2")
    ]
    assert len(table_rows) == 2
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
