"""``manygpu bench train``: throughput and scaling over 1, 2, ... N workers."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from manygpu.cli.launch import add_launch_options, launch_job
from manygpu.cli.notes import Notes, add_quiet
from manygpu.cli.tracking_flags import add_tracking_options, chosen
from manygpu.errors import UsageError
from manygpu.flags import positive_float, positive_int

if TYPE_CHECKING:
    from manygpu.bench import train_report
    from manygpu.bench.train import TrainBenchConfig, TrainJob

DESCRIPTION = """Train a model for a few steps on 1, 2, ... N workers (one job per count,
under the launcher) and report samples/s, speed-up, scaling efficiency and each
step split into compute, exposed communication and data-loading wait (the three
add up to the step); on GPUs also MFU. Prints a table; --json PATH also writes
JSON, a markdown table and a PNG plot next to it. Models: built-in demo-cnn,
resnet, gpt, or module:function returning a manygpu.bench.models.Workload. On a
GPU the built-ins are sized as GPUs are measured (gpt: GPT-2 small, 124M,
sequence 1024; resnet: ResNet-50 at 224x224); on the CPU they are small (--size).
Worker counts are per node; with --nnodes M every node runs this same command."""


def add_kind(kinds: Any) -> None:
    t = kinds.add_parser(
        "train",
        help="training throughput and scaling efficiency",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_options(t)
    t.add_argument("--model", default="resnet", help="demo-cnn, resnet, gpt or module:function")
    t.add_argument(
        "--workers", default="", help="comma list, e.g. 1,2,4 (default: 1,2,4..GPUs, or 1,2 on CPU)"
    )
    t.add_argument(
        "--size",
        default="auto",
        choices=("auto", "small", "full"),
        help="built-in models' size: full on a GPU, small on the CPU (auto)",
    )
    t.add_argument(
        "--batch",
        type=positive_int,
        help="samples per worker per step (default: the model's; 16 for GPT-2, 128 for "
        "ResNet-50, 32 for the small ones)",
    )
    t.add_argument("--steps", type=positive_int, default=20, help="timed steps per job")
    t.add_argument("--warmup", type=positive_int, default=5)
    t.add_argument("--block", type=positive_int, default=5, help="steps per timing block")
    t.help_later(t.add_argument("--precision"), _precision_help)
    t.add_argument(
        "--compile", action="store_true", help="Parallel(compile=True): torch.compile the model"
    )
    t.add_argument("--strategy", default="", help="strategy with >1 worker (default ddp)")
    t.add_argument(
        "--threads",
        type=positive_int,
        default=0,
        help="CPU threads per worker, the same at every count (default: CPUs / max workers)",
    )
    t.add_argument("--peak-tflops", type=positive_float, help="peak TFLOP/s per worker for MFU")
    t.add_argument("--json", default="", help="write the results here (default: no files)")
    t.add_argument("--markdown", default="", help="a markdown table (default: --json's path, .md)")
    t.add_argument("--plot", default="", help="a PNG plot (default: --json's path, .png)")
    add_tracking_options(t)
    add_quiet(t)
    t.set_defaults(run=run_train)


def _precision_help() -> str:
    from manygpu.core.config import PRECISIONS

    return f"one of: {', '.join(PRECISIONS)} (default: Parallel's)"


def parse_workers(text: str, gpus: int) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; empty: powers of two up to the GPUs (and all of them), or 1,2."""
    if not text.strip():
        if gpus <= 1:
            return [1, 2] if gpus == 0 else [1]
        counts = [1 << i for i in range(gpus.bit_length()) if 1 << i <= gpus]
        return counts if counts[-1] == gpus else [*counts, gpus]
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(
            f"--workers {text!r} is not a comma list of integers, e.g. 1,2,4"
        ) from None
    if not counts or any(c < 1 for c in counts):
        raise UsageError(f"--workers {text!r}: every count must be >= 1")
    if len(set(counts)) != len(counts):
        raise UsageError(f"--workers {text!r} repeats a count")
    if gpus and max(counts) > gpus:
        raise UsageError(f"--workers {text!r}: this node has only {gpus} GPU(s)")
    return sorted(counts)


def bench_config(ns: argparse.Namespace) -> TrainBenchConfig:
    """What every job runs, from the options (validated on construction)."""
    from manygpu.bench.train import TrainBenchConfig

    log_with, run_dir = chosen(ns)  # one run per job, side by side in the run directory
    return TrainBenchConfig(
        model=ns.model,
        size=ns.size,
        batch=ns.batch,
        steps=ns.steps,
        warmup=ns.warmup,
        block=ns.block,
        precision=ns.precision,
        compile=ns.compile,
        strategy=ns.strategy or None,
        peak_tflops=ns.peak_tflops or None,
        log_with=log_with,
        run_dir=run_dir,
    )


def _validate(ns: argparse.Namespace) -> tuple[list[int], TrainBenchConfig, int]:
    """Fail in a second, before any job starts: counts, config, the model's factory."""
    import torch

    from manygpu.bench import models
    from manygpu.bench.train import parallel_fields, parallel_options
    from manygpu.runtime.device import cpu_count

    if ns.nproc_per_node is not None:
        raise UsageError(
            "bench train sets the workers per job itself; use --workers, not --nproc-per-node"
        )
    gpus = torch.cuda.device_count() if ns.gpus is None else len(ns.gpus.split(","))
    counts = parse_workers(ns.workers, gpus)
    config = bench_config(ns)
    parallel_options(config, parallel_fields())  # e.g. --compile from a manygpu without it
    if ns.strategy:
        from manygpu.strategies import spec_class

        spec_class(ns.strategy)
    models.resolve(ns.model)
    threads = ns.threads or (max(1, cpu_count() // max(counts)) if gpus == 0 else 0)
    return counts, config, threads


def run_train(ns: argparse.Namespace) -> int:
    from manygpu.bench import train_report
    from manygpu.bench.train import RunStats, TrainJob

    counts, config, threads = _validate(ns)
    runs: list[RunStats] = []
    with tempfile.TemporaryDirectory(prefix="manygpu-bench-train-") as tmp:
        jobs = {
            n: TrainJob(bench=config, threads=threads, out=str(Path(tmp) / f"run-{n}.json"))
            for n in counts
        }  # built before the first job starts, so bad input fails at once
        note = Notes.of("manygpu bench train", ns)
        for index, (count, job) in enumerate(jobs.items(), 1):
            note(job_note(index, len(jobs), count, ns.model, config))
            options = copy.copy(ns)
            options.nproc_per_node = count
            env = job_env(job)
            start = time.monotonic()
            rc = launch_job(options, "manygpu.bench.train_worker", True, (), worker_env=env)
            if rc != 0:
                return rc
            note(f"job {index}/{len(jobs)} done in {time.monotonic() - start:.0f} s")
            out = Path(job.out)
            if out.exists():  # only node 0 holds rank 0's file
                runs.append(RunStats(**json.loads(out.read_text())))
    if not runs:
        return 0
    rows = train_report.scaling(runs)
    train_report.print_table(rows)
    write_views(ns, rows)
    return 0


def job_env(job: TrainJob) -> dict[str, str]:
    """The job handed to its workers, and their thread count when the bench sets it: the
    launcher's ``OMP_NUM_THREADS=<CPUs / workers>`` line would otherwise name a count
    the workers do not keep (they set ``job.threads``)."""
    from manygpu.runtime import handoff

    env = handoff.worker_env(job)
    if job.threads:
        env["OMP_NUM_THREADS"] = str(job.threads)
    return env


def job_note(index: int, jobs: int, workers: int, model: str, config: TrainBenchConfig) -> str:
    """What one job is about to do: the 20-40 s it takes are no longer silent."""
    return (
        f"job {index}/{jobs}: {model} on {workers} worker(s) per node: starting the workers, "
        f"then {config.warmup} warm-up and {config.steps} timed steps"
        + (" (and as many without gradient sync)" if workers > 1 else "")
    )


def view_paths(
    json_out: str, markdown: str, plot: str
) -> tuple[Path | None, Path | None, Path | None]:
    """Where the JSON, markdown and PNG go: only where asked.

    ``--json PATH`` also puts the other two next to it (``.md``, ``.png``)
    unless they were given; with no path at all nothing is written, so a run
    never leaves files in whatever directory it was started from.
    """
    json_path = Path(json_out) if json_out else None
    md_path = Path(markdown) if markdown else json_path.with_suffix(".md") if json_path else None
    png_path = Path(plot) if plot else json_path.with_suffix(".png") if json_path else None
    return json_path, md_path, png_path


def write_views(ns: argparse.Namespace, rows: list[train_report.ScalingRow]) -> None:
    """The JSON, markdown and PNG views that were asked for."""
    from manygpu.bench import report, train_report

    json_path, md_path, png_path = view_paths(ns.json, ns.markdown, ns.plot)
    if json_path is not None:
        command = " ".join(["manygpu", *sys.argv[1:]])
        report.write_json(json_path, train_report.payload(rows, command, report.machine_info()))
    if md_path is not None:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(train_report.markdown(rows))
    if png_path is not None:
        train_report.plot(rows, png_path)
    written = [str(p) for p in (json_path, md_path, png_path) if p is not None]
    if written:
        print(f"wrote {', '.join(written)}")
