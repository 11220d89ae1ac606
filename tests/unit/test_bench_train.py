"""bench train: the scaling arithmetic, the views and bad input (a real run: tests/launch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from manygpu.bench import mfu, models, nets, train_report
from manygpu.bench.train import (
    RunStats,
    TrainBenchConfig,
    TrainJob,
    measure,
    parallel_options,
    resolved_precision,
    split_step,
    steps_per_epoch,
)
from manygpu.cli.bench_train import bench_config, job_env, parse_workers, view_paths
from manygpu.cli.main import build_parser, main
from manygpu.core.parallel import Parallel
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
    assert train_report.NOTE in md  # how step, compute, comm and data relate
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
    assert w.parameters > 0 and w.name == name and w.batch == 32


def test_full_sizes_are_gpt2_small_and_resnet50() -> None:
    """The GPU sizes: the published parameter counts, and FLOPs that match the formulas."""
    with torch.device("meta"):  # shapes only: no 124M-parameter initialisation on the CPU
        gpt, resnet = models.build("gpt", "full"), models.build("resnet", "full")
    assert (gpt.name, gpt.parameters, gpt.batch) == ("gpt2-124m", 124_439_808, 16)
    assert (resnet.name, resnet.parameters, resnet.batch) == ("resnet50", 25_557_032, 128)
    x, _ = gpt.make_batch(1, torch.Generator().manual_seed(0))
    assert x.shape == (1, 1024) and int(x.max()) < 50257
    # Per token, forward: 2 x (12 layers x 12 d^2 + d x vocab) for the weights, plus
    # 2 x 2 x T x d per layer for attention's two matmuls; training is 3x forward.
    d, t = 768, 1024
    per_token = 3 * (2 * (12 * 12 * d * d + d * 50257) + 12 * 4 * t * d)
    cpu = torch.device("cpu")
    assert mfu.step_flops(gpt, 2, cpu) == 2 * t * per_token
    # ResNet-50: 4.09 G multiply-adds per 224x224 image forward (torchvision's figure).
    assert mfu.step_flops(resnet, 2, cpu) == pytest.approx(2 * 3 * 2 * 4.09e9, rel=0.02)
    assert nets.GPT2_355M.layers == 24 and nets.GPT2_355M.dim == 1024


def test_size_follows_the_device() -> None:
    assert models.size_for("auto", "cpu") == "small"
    assert models.size_for("auto", "cuda") == "full"
    assert models.size_for("small", "cuda") == "small" and models.size_for("full", "cpu") == "full"
    with pytest.raises(UsageError, match="unknown size 'huge'"):
        models.size_for("huge", "cpu")
    with pytest.raises(UsageError, match="unknown size"):
        TrainBenchConfig(size="huge")


def test_the_split_adds_up_to_the_step() -> None:
    # The reported case: compute 780 ms (from no-sync steps) inside a 741 ms step.
    part = split_step(0.741, 0.001, 0.780)
    assert (part.compute_s, part.comm_s, part.data_s) == pytest.approx((0.740, 0.0, 0.001))
    for step, data, nosync in ((0.1, 0.005, 0.08), (0.1, 0.2, 0.05), (0.1, -1e-9, None)):
        part = split_step(step, data, nosync)
        assert part.compute_s + part.comm_s + part.data_s == pytest.approx(step, abs=1e-15)
        assert min(part.compute_s, part.comm_s, part.data_s) >= 0
    assert split_step(0.1, 0.005, 0.08).comm_s == pytest.approx(0.015)
    assert split_step(0.1, 0.005, None).comm_s == 0.0  # one worker: nothing to synchronise


def test_a_measured_run_adds_up_and_names_its_precision() -> None:
    """One real in-process run on the CPU: the parts of the step sum to the step."""
    cfg = TrainBenchConfig(model="demo-cnn", batch=8, steps=3, warmup=1, block=2)
    with Parallel(strategy="single", device="cpu") as par:
        torch.manual_seed(0)
        stats = measure(par, models.build("demo-cnn"), cfg)
        assert resolved_precision(par) == "fp32" == stats.precision
    assert stats.compute_s + stats.comm_s + stats.data_s == pytest.approx(stats.step_s)
    assert stats.comm_s == 0.0 and stats.nosync_compute_s is None
    assert stats.batch_per_worker == 8 and stats.mfu is None and not stats.compiled
    with Parallel(strategy="single", device="cpu", precision="bf16") as par:
        assert resolved_precision(par) == "bf16"


def test_fp8_runs_are_named_fp8_and_counted_against_the_16_bit_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MANYGPU_FP8_EMULATE", "1")  # the CPU's emulation of float8
    with Parallel(strategy="single", device="cpu", precision="fp8") as par:
        assert resolved_precision(par) == "fp8"  # its autocast alone says bf16
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 989.0


def test_synthetic_data_stays_small() -> None:
    resnet50_batch = 128 * 3 * 224 * 224 * 4 + 128 * 8
    assert steps_per_epoch(resnet50_batch, 45) == 6  # 77 MB batches: 512 MB at most
    assert steps_per_epoch(1024, 45) == 45 and steps_per_epoch(1024, 500) == 64
    assert steps_per_epoch(10**12, 45) == 2


def test_parallel_gets_only_what_was_chosen() -> None:
    everything = {"strategy", "precision", "compile", "timeout_s"}
    assert parallel_options(TrainBenchConfig(), everything) == {"strategy": None, "timeout_s": 600}
    cfg = TrainBenchConfig(precision="bf16", compile=True, strategy="ddp")
    assert parallel_options(cfg, everything) == {
        "strategy": "ddp", "timeout_s": 600, "precision": "bf16", "compile": True,
    }  # fmt: skip
    with pytest.raises(UsageError, match="leave out --compile"):
        parallel_options(cfg, everything - {"compile"})


def test_cli_options_reach_the_config() -> None:
    ns = build_parser().parse_args(
        ["bench", "train", "--model", "gpt", "--compile", "--size", "small", "--batch", "4"]
    )
    cfg = bench_config(ns)
    assert (cfg.compile, cfg.size, cfg.batch, cfg.precision) == (True, "small", 4, None)
    ns = build_parser().parse_args(["bench", "train"])
    assert (bench_config(ns).compile, bench_config(ns).size, bench_config(ns).batch) == (
        False, "auto", None,
    )  # fmt: skip
    assert ns.json == ""  # no file unless asked


def test_the_workers_thread_count_is_the_one_the_launcher_names(tmp_path: Path) -> None:
    """The launcher's ``OMP_NUM_THREADS=`` line names the variable the workers get."""
    config = bench_config(build_parser().parse_args(["bench", "train"]))
    pinned = job_env(TrainJob(bench=config, threads=1, out=str(tmp_path / "a.json")))
    assert pinned["OMP_NUM_THREADS"] == "1"
    gpus = job_env(TrainJob(bench=config, threads=0, out=str(tmp_path / "b.json")))
    assert "OMP_NUM_THREADS" not in gpus  # torch's choice: the launcher's own line stands


def test_files_only_where_asked(tmp_path: Path) -> None:
    assert view_paths("", "", "") == (None, None, None)
    out = tmp_path / "r" / "train.json"
    assert view_paths(str(out), "", "") == (out, out.with_suffix(".md"), out.with_suffix(".png"))
    assert view_paths("", "t.md", "") == (None, Path("t.md"), None)


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
        TrainBenchConfig(precision="fp4")


def test_peaks_and_mfu() -> None:
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert mfu.peak_tflops("Tesla V100-SXM2-16GB", "fp16") == 125.0
    assert mfu.peak_tflops("cpu", "fp32") is None
    # fp32 on tensor cores (TF32) has its own ceiling; V100 has no TF32.
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 494.7
    assert mfu.peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == 156.0
    assert mfu.peak_tflops("Tesla V100-SXM2-16GB", "fp32", tf32=True) == 15.7
    assert mfu.mfu(10**12, 2.0, 4.0) == pytest.approx(0.5)
    assert mfu.mfu(10**12, 2.0, None) is None


def test_tf32_is_read_from_torch() -> None:
    """Matmuls use TF32 only when asked; cuDNN convolutions do by default."""
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert not mfu.tf32_in_use(convolutions=False)
        assert mfu.tf32_in_use(convolutions=True) == (
            torch.backends.cudnn.conv.fp32_precision == "tf32" and torch.backends.cudnn.enabled
        )
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert mfu.tf32_in_use(convolutions=False)
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    assert mfu.has_convolutions(models.build("resnet").model)
    assert not mfu.has_convolutions(models.build("gpt").model)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--model", "no_such_module_xyz:f"], "cannot import module"),
        (["--model", "resnet", "--workers", "0,1"], "must be >= 1"),
        (["--model", "resnet", "--workers", "1,x"], "comma list of integers"),
        (["--model", "resnet", "--nproc-per-node", "2"], "use --workers"),
        (["--model", "resnet", "--precision", "fp4"], "unknown precision 'fp4'"),
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
def test_compile_flag_compiles_the_benchmarked_model() -> None:
    """--compile reaches Parallel(compile=True): dynamo compiles graphs during the run
    (CPU inductor; ~30 s, hence slow)."""
    from torch._dynamo.utils import counters

    from manygpu.bench.train import parallel_fields

    counters.clear()
    cfg = TrainBenchConfig(model="demo-cnn", batch=8, steps=2, warmup=1, block=2, compile=True)
    with Parallel(**parallel_options(cfg, parallel_fields()), device="cpu") as par:
        stats = measure(par, models.build("demo-cnn"), cfg)
    assert counters["stats"]["unique_graphs"] >= 1
    assert stats.compiled and stats.compute_s + stats.data_s == pytest.approx(stats.step_s)
