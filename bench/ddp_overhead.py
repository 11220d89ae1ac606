"""How much does manygpu's ``ddp`` strategy cost over hand-written DDP?

Trains the same model (``SimpleCNN`` on the digits upsampled to 28x28, the
shape of PyTorch's MNIST example) on the same data, with the same per-rank
batch, optimizer and threads, in 2 CPU processes over gloo, written four ways:

- ``torch_ddp``: plain torch, as the tutorials write it: ``init_process_group``,
  ``DistributedDataParallel``, ``DistributedSampler`` + ``set_epoch``, a manual loop;
- ``manygpu``: ``Parallel(strategy="ddp")`` with its defaults;
- ``accelerate`` and ``fabric``: Hugging Face Accelerate and Lightning Fabric,
  when importable by this interpreter (skipped with a note otherwise).

Each run launches the ranks afresh (``python -m torch.distributed.run``, or
``manygpu launch`` with ``--launcher manygpu``; every variant gets the same
launcher) and times a fixed number of steps after a warm-up, between two
barriers; rank 0 writes samples/s to a JSON file. Start-up is not timed.

The machine is noisy, so the variants' runs are interleaved: every round runs
each variant once, and the order rotates from round to round (A B, B A, A B...)
so no variant always goes first. The ratio to ``torch_ddp`` is the median of
the per-round ratios, which cancels drift that affects a whole round.

Run::

    .venv/bin/python bench/ddp_overhead.py            # 5 rounds: ~3 min for 2 variants, ~6 for 4
    .venv/bin/python bench/ddp_overhead.py --quick    # smoke run, ~30-40 s

To include Accelerate and Fabric, run it with an interpreter that can import
them (they are not dependencies of manygpu). Results: a table on stdout and
JSON (default ``bench/results/ddp_overhead.json``) with the command line, the
machine, the date and every run's raw numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ddp_overhead_worker.py"
BASELINE = "torch_ddp"


@dataclass(frozen=True)
class Variant:
    """One way of writing the same DDP training."""

    name: str
    """Key passed to the worker's ``--variant``."""
    label: str
    """How the table names it."""
    requires: tuple[str, ...] = ()
    """Modules that must be importable, else the variant is skipped."""


VARIANTS: tuple[Variant, ...] = (
    Variant(BASELINE, "hand-written DDP"),
    Variant("manygpu", "manygpu ddp"),
    Variant("accelerate", "Accelerate", ("accelerate",)),
    Variant("fabric", "Lightning Fabric", ("lightning_fabric",)),
)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure and how often."""

    rounds: int
    """Rounds; each runs every variant once."""
    steps: int
    """Timed steps per run."""
    warmup: int
    """Untimed steps before them."""
    batch_size: int
    """Samples per rank per step."""
    image_size: int
    """Side of the images fed to SimpleCNN."""
    nproc: int
    """Ranks per run."""
    threads: int
    """``OMP_NUM_THREADS`` of every rank."""
    launcher: str
    """``torchrun`` or ``manygpu``: what starts each run's ranks."""
    variants: tuple[str, ...]
    """Variants asked for, baseline first."""
    run_timeout_s: float
    """A run taking longer is killed and recorded as failed."""

    def __post_init__(self) -> None:
        for name, value in (("rounds", self.rounds), ("steps", self.steps), ("nproc", self.nproc)):
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        known = {v.name for v in VARIANTS}
        unknown = [v for v in self.variants if v not in known]
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown}; choose from {sorted(known)}")


@dataclass
class RunRecord:
    """One launch of one variant: the raw data."""

    round: int
    """1-based."""
    position: int
    """Place of this run within its round (0 = first)."""
    variant: str
    ok: bool
    wall_s: float
    """Whole launch, start-up and teardown included."""
    samples_per_s: float | None = None
    seconds: float | None = None
    """Timed part only."""
    threads_per_rank: int | None = None
    final_loss: float | None = None
    error: str | None = None
    """Why the run failed: timeout or exit code, and the exception a rank raised."""
    output_tail: str | None = None
    """Last lines of the launcher's output, for failed runs."""


@dataclass
class VariantSummary:
    """A variant's runs reduced to what the table shows."""

    variant: str
    label: str
    runs_ok: int
    runs: int
    median: float | None
    min: float | None
    max: float | None
    ratio_to_baseline: float | None
    """Median over rounds of this variant's samples/s over the baseline's in that round."""
    per_round_ratios: list[float] = field(default_factory=list)
    median_wall_s: float | None = None
    final_loss: float | None = None


@dataclass
class BenchReport:
    """Everything a run of this benchmark produced."""

    command: str
    date: str
    machine: dict[str, Any]
    config: BenchConfig
    skipped: dict[str, str]
    runs: list[RunRecord]
    summaries: list[VariantSummary]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- environment ----------------------------------------------------------------
def split_available(names: tuple[str, ...]) -> tuple[list[Variant], dict[str, str]]:
    """(variants this interpreter can run, {skipped variant: why})."""
    by_name = {v.name: v for v in VARIANTS}
    runnable, skipped = [], {}
    for name in names:
        variant = by_name[name]
        missing = [m for m in variant.requires if importlib.util.find_spec(m) is None]
        if missing:
            skipped[name] = f"not installed for {sys.executable} (no module {', '.join(missing)})"
        else:
            runnable.append(variant)
    return runnable, skipped


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Facts that make numbers comparable (or not) between machines."""
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        usable = os.cpu_count() or 1
    versions = {
        name: _version(name)
        for name in ("torch", "manygpu", "accelerate", "lightning-fabric", "numpy")
    }
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_threads_default": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": versions,
    }


def run_env(cfg: BenchConfig) -> dict[str, str]:
    """The same environment for every run: CPU only, fixed threads, loopback gloo."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(cfg.threads)
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU/gloo benchmark, even on a GPU machine
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks are local; what manygpu launch does too
    return env


# -- measuring ------------------------------------------------------------------
def launch_command(cfg: BenchConfig, variant: str, out: Path) -> list[str]:
    """The command that runs one variant on ``cfg.nproc`` ranks."""
    if cfg.launcher == "manygpu":
        head = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", str(cfg.nproc)]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        head += ["--nproc-per-node", str(cfg.nproc)]
    worker_args = [
        "--variant", variant, "--steps", str(cfg.steps), "--warmup", str(cfg.warmup),
        "--batch-size", str(cfg.batch_size), "--image-size", str(cfg.image_size),
        "--out", str(out),
    ]  # fmt: skip
    return [*head, str(WORKER), *worker_args]


# "ValueError: ...", "[rank1]:torch.OutOfMemoryError: ..." as Python prints them.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:)?\s*([\w.]*(?:Error|Exception|Interrupt)\b.*)$")


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def failure_reason(output: str) -> str | None:
    """The last exception line a rank printed, if any (the launcher's summary buries it)."""
    found = [m.group(1) for line in output.splitlines() if (m := _EXCEPTION_LINE.match(line))]
    real = [f for f in found if not f.startswith(("torch.distributed.elastic", "SignalException"))]
    return (real or found or [None])[-1]


def run_launcher(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run a launcher; (exit code or None on timeout, its output).

    On timeout the launcher gets SIGTERM first: torch's agent then stops its
    workers, which run in sessions of their own and would outlive a SIGKILL
    of the launcher alone.
    """
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        return None, output


def run_once(cfg: BenchConfig, variant: str, round_: int, position: int, tmp: Path) -> RunRecord:
    """Launch one variant and read what its rank 0 wrote."""
    out = tmp / f"{variant}-r{round_}.json"
    start = time.perf_counter()
    code, output = run_launcher(launch_command(cfg, variant, out), run_env(cfg), cfg.run_timeout_s)
    wall = time.perf_counter() - start
    if code != 0 or not out.exists():
        why = f"timed out after {cfg.run_timeout_s:.0f} s" if code is None else f"exit code {code}"
        reason = failure_reason(output) if code is not None else None
        error = f"{why}: {reason}" if reason else why
        return RunRecord(
            round_, position, variant, False, wall, error=error, output_tail=_tail(output)
        )
    data = json.loads(out.read_text())
    return RunRecord(
        round_, position, variant, True, wall,
        samples_per_s=data["samples_per_s"], seconds=data["seconds"],
        threads_per_rank=data["threads_per_rank"], final_loss=data["final_loss"],
    )  # fmt: skip


def round_order(variants: list[str], round_: int) -> list[str]:
    """Rotate the order each round so no variant always runs first."""
    k = round_ % len(variants)
    return variants[k:] + variants[:k]


def run_rounds(cfg: BenchConfig, variants: list[str], console: Console) -> list[RunRecord]:
    """All runs, interleaved: round 1 runs every variant, then round 2, ..."""
    records: list[RunRecord] = []
    with tempfile.TemporaryDirectory(prefix="ddp_overhead-") as tmp:
        for round_ in range(cfg.rounds):
            for position, variant in enumerate(round_order(variants, round_)):
                record = run_once(cfg, variant, round_ + 1, position, Path(tmp))
                records.append(record)
                console.print(progress_line(cfg, record))
    return records


# -- summarising (data) and showing (views) ----------------------------------------
def summarize(runs: list[RunRecord], variants: list[Variant]) -> list[VariantSummary]:
    """Per-variant median/min/max and median per-round ratio to the baseline."""
    baseline = {
        r.round: r.samples_per_s
        for r in runs
        if r.variant == BASELINE and r.ok and r.samples_per_s is not None
    }
    summaries = []
    for variant in variants:
        mine = [r for r in runs if r.variant == variant.name]
        rates = [r.samples_per_s for r in mine if r.ok and r.samples_per_s is not None]
        ratios = [
            r.samples_per_s / baseline[r.round]
            for r in mine
            if r.ok and r.samples_per_s and baseline.get(r.round)
        ]
        walls = [r.wall_s for r in mine if r.ok]
        losses = [r.final_loss for r in mine if r.ok and r.final_loss is not None]
        summaries.append(
            VariantSummary(
                variant=variant.name,
                label=variant.label,
                runs_ok=len(rates),
                runs=len(mine),
                median=statistics.median(rates) if rates else None,
                min=min(rates) if rates else None,
                max=max(rates) if rates else None,
                ratio_to_baseline=statistics.median(ratios) if ratios else None,
                per_round_ratios=ratios,
                median_wall_s=statistics.median(walls) if walls else None,
                final_loss=losses[0] if losses else None,
            )
        )
    return summaries


def progress_line(cfg: BenchConfig, r: RunRecord) -> str:
    head = f"round {r.round}/{cfg.rounds}  {r.variant:<11}"
    if not r.ok:
        return f"{head} [red]failed[/] ({r.wall_s:.1f} s): {(r.error or '').splitlines()[0]}"
    return f"{head} {r.samples_per_s:8,.0f} samples/s  (run {r.wall_s:.1f} s)"


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render_table(report: BenchReport) -> Table:
    """The summary as a rich table (fits 80 columns)."""
    table = Table(title="DDP overhead: samples/s over all ranks (higher is better)")
    for name in ("variant", "runs", "median", "min", "max", "ratio", "run s", "loss"):
        table.add_column(name, justify="left" if name == "variant" else "right")
    for s in report.summaries:
        table.add_row(
            s.label,
            f"{s.runs_ok}/{s.runs}",
            _num(s.median, ",.0f"),
            _num(s.min, ",.0f"),
            _num(s.max, ",.0f"),
            _num(s.ratio_to_baseline, ".3f"),
            _num(s.median_wall_s, ".1f"),
            _num(s.final_loss, ".4f"),
        )
    return table


def render_notes(report: BenchReport) -> list[str]:
    """What the table's columns mean, how it was measured, and what was skipped."""
    cfg = report.config
    launcher = "torch.distributed.run" if cfg.launcher == "torchrun" else "manygpu launch"
    skipped = [f"skipped {name}: {why}" for name, why in report.skipped.items()]
    return [
        f"SimpleCNN on {cfg.image_size}x{cfg.image_size} digits, {cfg.nproc} CPU ranks (gloo), "
        f"{cfg.threads} thread(s) each, batch {cfg.batch_size} per rank, {cfg.steps} timed steps "
        f"after {cfg.warmup} warm-up, {cfg.rounds} interleaved rounds, launched by {launcher}.",
        "ratio: median over rounds of samples/s divided by hand-written DDP's in the same "
        "round. run s: median wall time of a whole run, start-up included (samples/s is not). "
        "loss: final loss of the first run; equal losses mean the same samples, order and "
        "updates.",
        *loss_mismatches(report.summaries),
        *skipped,
    ]


def loss_mismatches(summaries: list[VariantSummary]) -> list[str]:
    """A line per variant whose final loss is not the baseline's: it trained differently.

    Every variant gets the same model, data, seed and loader order, so with the
    same updates the losses are bit-equal; a difference means the comparison
    also measured different work (another data split, another dropout stream).
    """
    base = next((s.final_loss for s in summaries if s.variant == BASELINE), None)
    if base is None:
        return []
    return [
        f"[yellow]{s.label} ends at loss {s.final_loss:.4f}, hand-written DDP at {base:.4f}: "
        "not the same training[/]"
        for s in summaries
        if s.final_loss is not None and s.final_loss != base
    ]


# -- entry point --------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 20 steps")
    p.add_argument("--rounds", type=int, default=None, help="default 5 (2 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps; default 150 (20)")
    p.add_argument("--warmup", type=int, default=None, help="default 20 (3 with --quick)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--nproc", type=int, default=2, help="ranks per run")
    p.add_argument("--threads", type=int, default=None, help="per rank; default CPUs / nproc")
    p.add_argument("--launcher", choices=("torchrun", "manygpu"), default="torchrun")
    p.add_argument(
        "--variants",
        default=",".join(v.name for v in VARIANTS),
        help="comma-separated subset of: " + ", ".join(v.name for v in VARIANTS),
    )
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=HERE / "results" / "ddp_overhead.json")
    ns = p.parse_args(argv)
    try:
        return config_from_args(ns), ns.out
    except ValueError as exc:
        p.error(str(exc))


# Full-run and --quick defaults of the options left unset.
FULL = {"rounds": 5, "steps": 150, "warmup": 20}
QUICK = {"rounds": 2, "steps": 20, "warmup": 3}


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    """Fill the unset options from FULL or QUICK and validate."""
    from manygpu.runtime.device import cpu_count  # affinity-aware CPU count

    defaults = QUICK if ns.quick else FULL
    unset = {k: v for k, v in defaults.items() if getattr(ns, k) is None}
    names = [n.strip() for n in ns.variants.split(",") if n.strip()]
    names.sort(key=lambda n: n != BASELINE)  # stable sort: the baseline leads round 1
    return BenchConfig(
        rounds=unset.get("rounds", ns.rounds),
        steps=unset.get("steps", ns.steps),
        warmup=unset.get("warmup", ns.warmup),
        batch_size=ns.batch_size,
        image_size=ns.image_size,
        nproc=ns.nproc,
        threads=ns.threads or max(1, cpu_count() // ns.nproc),
        launcher=ns.launcher,
        variants=tuple(names),
        run_timeout_s=ns.run_timeout,
    )


def run_benchmark(cfg: BenchConfig, console: Console) -> BenchReport:
    """Measure every available variant; the report is the data, nothing printed but progress."""
    variants, skipped = split_available(cfg.variants)
    machine = machine_info()
    runs = run_rounds(cfg, [v.name for v in variants], console)
    machine["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return BenchReport(
        command=shlex.join([sys.executable, *sys.argv]),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine=machine,
        config=cfg,
        skipped=skipped,
        runs=runs,
        summaries=summarize(runs, variants),
    )


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    console = Console(highlight=False)
    report = run_benchmark(cfg, console)
    console.print()
    console.print(render_table(report))
    for line in render_notes(report):
        console.print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    console.print(f"raw results: {out}")
    failed = [r for r in report.runs if not r.ok]
    for r in failed:
        console.print(f"[red]round {r.round} {r.variant} failed[/]: {r.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
