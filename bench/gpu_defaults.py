"""Is manygpu the fastest way to train on a GPU without tuning? Defaults vs recipes.

Trains the same models on one device, one process per run, written several ways:

- ``classic``: the 2018 recipe: fp32, ``nn.DataParallel``, plain AdamW;
- ``hand`` / ``hand_compile``: ten lines of hand-tuning (TF32, bf16 autocast,
  fused AdamW, pinned non-blocking copies, channels_last for conv nets), without
  and with ``torch.compile``;
- ``manygpu``: ``Parallel()`` with its defaults; ``manygpu_bf16``:
  ``Parallel(precision="bf16")``; ``manygpu_bf16_user_compile``: that plus the
  user's own ``torch.compile``; ``manygpu_compile``: ``Parallel(compile=True)``;
  ``manygpu_off``: every new default switched off
  (``precision="fp32-strict", channels_last=False``); ``manygpu_fp8``:
  ``Parallel(precision="fp8")`` (torchao float8 linears), on GPT-2 355M only and
  only on GPUs with FP8 tensor cores (compute capability 8.9+; skipped with the
  reason elsewhere), compared with ``manygpu_bf16``; ``manygpu_ac_full`` /
  ``manygpu_ac_selective``: ``Parallel(precision="bf16",
  activation_checkpointing="full" | "selective")`` on GPT-2 355M on a GPU only,
  whose step time (the ``x manygpu_bf16`` ratio) and peak memory (``peak GB``,
  ``torch.cuda.max_memory_allocated``) against ``manygpu_bf16`` are
  checkpointing's cost and saving (MFU counts the model's FLOPs, not the recomputation);
- ``accelerate`` / ``fabric``: Accelerate bf16 and Fabric bf16-mixed, when importable.

Models: GPT-2 124M (batch 16 x 1024 tokens), GPT-2 355M (24 x 1024, batch 8) and
ResNet-50 (224x224, batch 128) on a GPU; a tiny GPT and a CIFAR-size ResNet on
the CPU (``--cpu``, or automatically without CUDA), where the GPU-only variants
(TF32, bf16 autocast, pinned copies) are skipped and the question is whether any
new default slows the CPU path (``manygpu`` vs ``manygpu_off`` and ``classic``).
A variant needing an option this manygpu's ``Parallel`` lacks (``compile``,
``precision="fp32-strict"``) is skipped with a note, so the script runs before
and after those land. Plus a checkpoint row (GPT-355M + AdamW state on a GPU):
``torch.save`` / ``torch.load`` against ``Checkpointer`` blocking and async.

Runs are interleaved: every round runs each variant once per model, in an order
that rotates from round to round; a ratio is the median of per-round ratios.
MFU is FLOPs per step (counted by ``FlopCounterMode``) x steps/s over the GPU's
dense 16-bit peak, one reference for every variant, so MFUs compare like rates.

    .venv/bin/python bench/gpu_defaults.py            # GPU: 3 models x 10 variants x 3 rounds
    .venv/bin/python bench/gpu_defaults.py --quick    # smoke run
    .venv/bin/python bench/gpu_defaults.py --cpu --quick

Prints a table per model and writes JSON (default bench/results/gpu_defaults.json,
``gpu_defaults_cpu.json`` on the CPU) with the command, machine, date and every run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shlex
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
ROOT = HERE.parent
WORKER = HERE / "gpu_defaults_worker.py"
REFERENCES = ("classic", "hand", "hand_compile", "manygpu_off", "manygpu_bf16")
"""Variants every other one is compared with (when they ran)."""


@dataclass(frozen=True)
class Variant:
    """One way of writing the same single-device training."""

    name: str
    label: str
    gpu_only: bool = False
    """Uses GPU techniques (TF32, bf16 autocast on CUDA, pinned memory, compile)."""
    requires: tuple[str, ...] = ()
    """Modules of which one must be importable, else the variant is skipped."""
    parallel: tuple[tuple[str, Any], ...] = ()
    """``Parallel(...)`` options it passes: skipped when ``ParallelConfig`` lacks one."""
    fp8: bool = False
    """Needs FP8 tensor cores (CUDA compute capability 8.9+): skipped, with the reason,
    on other GPUs."""
    models: tuple[str, ...] = ()
    """Only these models (empty: every model)."""
    gpu_why: str = "GPU techniques (TF32, bf16 autocast on CUDA, pinned copies)"
    """Why a ``gpu_only`` variant is skipped on the CPU."""

    def trains(self, model: str) -> bool:
        return not self.models or model in self.models


VARIANTS: tuple[Variant, ...] = (
    Variant("classic", "classic recipe (fp32, nn.DataParallel, plain AdamW)"),
    Variant("hand", "hand-tuned (TF32, bf16 autocast, fused AdamW, pinned, NHWC)", True),
    Variant("hand_compile", "hand-tuned + torch.compile", True),
    Variant("manygpu", "manygpu Parallel() defaults"),
    Variant(
        "manygpu_bf16", 'manygpu Parallel(precision="bf16")', parallel=(("precision", "bf16"),)
    ),
    Variant(
        "manygpu_bf16_user_compile",
        'Parallel(precision="bf16") + user torch.compile',
        parallel=(("precision", "bf16"),),
    ),
    Variant("manygpu_compile", "manygpu Parallel(compile=True)", parallel=(("compile", True),)),
    Variant(
        "manygpu_fp8",
        'manygpu Parallel(precision="fp8") (torchao float8)',
        True,
        requires=("torchao",),
        parallel=(("precision", "fp8"),),
        fp8=True,
        models=("gpt-355m",),
    ),
    *(
        Variant(
            f"manygpu_ac_{mode}",
            f'Parallel(precision="bf16", activation_checkpointing="{mode}")',
            True,
            parallel=(("precision", "bf16"), ("activation_checkpointing", mode)),
            models=("gpt-355m",),
            gpu_why="measures GPU step time and peak GPU memory on GPT-2 355M",
        )
        for mode in ("full", "selective")
    ),
    Variant(
        "manygpu_off",
        'manygpu, new defaults off ("fp32-strict", no channels_last)',
        parallel=(("precision", "fp32-strict"), ("channels_last", False)),
    ),
    Variant("accelerate", "Accelerate (bf16 on a GPU)", requires=("accelerate",)),
    Variant(
        "fabric",
        "Lightning Fabric (bf16-mixed on a GPU)",
        requires=("lightning_fabric", "lightning"),
    ),
)
BY_NAME = {v.name: v for v in VARIANTS}
GPU_MODELS = ("gpt-124m", "gpt-355m", "resnet-50")
CPU_MODELS = ("gpt-tiny", "resnet-tiny")
CPU_VARIANTS = ("classic", "manygpu", "manygpu_off", "accelerate", "fabric")
"""On the CPU by default: the compile variants work there but take minutes to compile."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure and how often."""

    cpu: bool
    """Tiny models on the CPU (no GPU-only variants)."""
    rounds: int
    steps: int
    """Timed steps per run."""
    warmup: int
    """Untimed steps first (compilation happens here)."""
    models: tuple[str, ...]
    variants: tuple[str, ...]
    """Baseline (classic) first."""
    batch: int | None
    """Samples per step; ``None``: each model's own."""
    checkpoint: bool
    """Also time saving and loading the largest model's state."""
    ckpt_dir: str
    run_timeout_s: float
    budget_s: float | None = None
    """Start no run after this many seconds (a lent GPU is time-boxed): the rounds done
    so far are summarised and written, the runs left out are listed."""
    threads: int | None = None
    """``OMP_NUM_THREADS`` of every run; ``None``: torch's default (all cores). On a
    shared machine, 1 keeps OpenMP's barriers from waiting on descheduled threads
    (two threads on two busy cores measured 4x slower than one)."""

    def __post_init__(self) -> None:
        for name in ("rounds", "steps", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        unknown = [v for v in self.variants if v not in BY_NAME]
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown}; choose from {sorted(BY_NAME)}")


@dataclass
class RunRecord:
    """One process: one variant training one model (or the checkpoint timings)."""

    model: str
    round: int
    position: int
    variant: str
    ok: bool
    wall_s: float
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Summary:
    """A variant on a model, reduced to what the table shows."""

    model: str
    variant: str
    label: str
    runs_ok: int
    runs: int
    unit: str
    median_rate: float | None
    """Tokens/s for GPTs, samples (images)/s otherwise."""
    mfu: float | None
    precision: str | None
    ratios: dict[str, float] = field(default_factory=dict)
    """Median per-round ratio to each reference variant that ran."""
    peak_memory_gb: float | None = None
    """Median peak of allocated GPU memory in a run (``None`` on the CPU)."""


# -- availability --------------------------------------------------------------------
def parallel_supports(options: tuple[tuple[str, Any], ...]) -> str | None:
    """Why ``Parallel(**options)`` cannot run with this manygpu, or ``None`` if it can."""
    from dataclasses import fields

    from manygpu.core.config import PRECISIONS, ParallelConfig

    names = {f.name for f in fields(ParallelConfig)}
    for key, value in options:
        if key not in names:
            return f"this manygpu's Parallel has no {key}= option"
        if key == "precision" and value not in PRECISIONS:
            return f"this manygpu's Parallel has no precision={value!r}"
    return None


FP8_CAPABILITY = (8, 9)


def gpu_capability() -> tuple[int, int] | None:
    """The first GPU's CUDA compute capability (``None`` without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return major, minor


def split_available(
    names: tuple[str, ...], cpu: bool, capability: tuple[int, int] | None = None
) -> tuple[list[Variant], dict[str, str]]:
    """(variants that can run here, {skipped variant: why}); ``capability``: the GPU's."""
    runnable, skipped = [], {}
    for name in names:
        v = BY_NAME[name]
        if v.requires and all(importlib.util.find_spec(m) is None for m in v.requires):
            skipped[name] = f"not installed for {sys.executable} ({' / '.join(v.requires)})"
        elif cpu and v.gpu_only:
            skipped[name] = v.gpu_why
        elif why := parallel_supports(v.parallel):
            skipped[name] = why
        elif v.fp8 and (capability is None or capability < FP8_CAPABILITY):
            has = (
                "no GPU"
                if capability is None
                else f"compute capability {capability[0]}.{capability[1]}"
            )
            skipped[name] = f"needs FP8 tensor cores (compute capability 8.9+); this GPU has {has}"
        else:
            runnable.append(v)
    return runnable, skipped


# -- running -------------------------------------------------------------------------
def run_env(cfg: BenchConfig) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    if cfg.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if cfg.threads:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    return env


def run_once(
    cfg: BenchConfig, model: str, variant: str, rnd: int, pos: int, tmp: Path
) -> RunRecord:
    """One process; the worker writes its result as JSON."""
    out = tmp / f"{model}-{variant}-r{rnd}.json"
    cmd = [
        sys.executable,
        str(WORKER),
        "--variant",
        variant,
        "--model",
        model,
        "--steps",
        str(cfg.steps),
        "--warmup",
        str(cfg.warmup),
        "--out",
        str(out),
        "--ckpt-dir",
        cfg.ckpt_dir,
    ]
    if cfg.batch:
        cmd += ["--batch", str(cfg.batch)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=run_env(cfg), capture_output=True, text=True, timeout=cfg.run_timeout_s
        )
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        code, output = None, f"timed out after {cfg.run_timeout_s:.0f} s"
    wall = time.perf_counter() - start
    if code != 0 or not out.exists():
        lines = [ln for ln in output.strip().splitlines() if ln.strip()] or ["no output"]
        return RunRecord(model, rnd, pos, variant, False, wall, error=f"exit {code}: {lines[-1]}")
    return RunRecord(model, rnd, pos, variant, True, wall, result=json.loads(out.read_text()))


def round_order(variants: list[str], rnd: int) -> list[str]:
    k = rnd % len(variants)
    return variants[k:] + variants[:k]


def run_rounds(cfg: BenchConfig, variants: list[str], console: Console) -> list[RunRecord]:
    """Round after round: every model with every variant (rotated), then the checkpoint."""
    records: list[RunRecord] = []
    deadline = None if cfg.budget_s is None else time.monotonic() + cfg.budget_s
    ckpt_model = CPU_MODELS[0] if cfg.cpu else "gpt-355m"
    with tempfile.TemporaryDirectory(prefix="gpu_defaults-") as tmp:
        for rnd in range(1, cfg.rounds + 1):
            jobs = round_jobs(cfg.models, variants, rnd)
            if cfg.checkpoint:
                jobs.insert(0, (ckpt_model, "checkpoint"))  # first: a spent budget keeps it
            for pos, (model, variant) in enumerate(jobs):
                if deadline is not None and time.monotonic() > deadline:
                    console.print(f"--budget-s {cfg.budget_s:g} spent: round {rnd} stops here")
                    return records
                record = run_once(cfg, model, variant, rnd, pos, Path(tmp))
                records.append(record)
                console.print(progress_line(cfg, record), highlight=False)
    return records


def round_jobs(models: tuple[str, ...], variants: list[str], rnd: int) -> list[tuple[str, str]]:
    """(model, variant) runs of round ``rnd``: each model with the variants that train it."""
    order = round_order(variants, rnd - 1)
    return [(m, v) for m in models for v in order if BY_NAME[v].trains(m)]


def progress_line(cfg: BenchConfig, r: RunRecord) -> str:
    head = f"round {r.round}/{cfg.rounds}  {r.model:<11} {r.variant:<26}"
    if not r.ok:
        return f"{head} [red]failed[/] ({r.wall_s:.0f} s): {r.error}"
    if r.variant == "checkpoint":
        res = r.result
        return (
            f"{head} torch.save {res['torch_save_s']:.2f} s, blocking "
            f"{res['blocking_save_s']:.2f} s, async stall {res['async_stall_s']:.2f} s"
        )
    res = r.result
    mfu = "" if res["mfu"] is None else f"  MFU {res['mfu']:.1%}"
    return f"{head} {res['units_per_s']:>12,.0f} {res['unit']}/s{mfu}  ({r.wall_s:.0f} s)"


# -- summarising (data) and showing (views) --------------------------------------------
def _ratio(runs: list[RunRecord], ref: dict[int, float]) -> float | None:
    ratios = [r.result["units_per_s"] / ref[r.round] for r in runs if r.ok and ref.get(r.round)]
    return statistics.median(ratios) if ratios else None


def summarize(
    runs: list[RunRecord], models: tuple[str, ...], variants: list[Variant]
) -> list[Summary]:
    """Per model and variant: median rate and MFU, and median per-round ratios."""
    out = []
    for model in models:
        mine = [r for r in runs if r.model == model and r.variant != "checkpoint"]
        rate = {(r.variant, r.round): r.result["units_per_s"] for r in mine if r.ok}
        for v in (v for v in variants if v.trains(model)):
            runs_v = [r for r in mine if r.variant == v.name]
            ok = [r.result for r in runs_v if r.ok]
            mfus = [x["mfu"] for x in ok if x["mfu"] is not None]
            peaks = [x["peak_memory_gb"] for x in ok if x.get("peak_memory_gb") is not None]
            ratios = {}
            for ref in REFERENCES:
                by_round = {rnd: val for (name, rnd), val in rate.items() if name == ref}
                if ref != v.name and (value := _ratio(runs_v, by_round)) is not None:
                    ratios[ref] = value
            out.append(
                Summary(
                    model=model,
                    variant=v.name,
                    label=v.label,
                    runs_ok=len(ok),
                    runs=len(runs_v),
                    unit=ok[0]["unit"] if ok else "samples",
                    median_rate=statistics.median(x["units_per_s"] for x in ok) if ok else None,
                    mfu=statistics.median(mfus) if mfus else None,
                    precision=ok[0]["precision"] if ok else None,
                    ratios=ratios,
                    peak_memory_gb=statistics.median(peaks) if peaks else None,
                )
            )
    return out


def summarize_checkpoint(runs: list[RunRecord]) -> dict[str, float]:
    """Medians over rounds of every checkpoint timing."""
    ok = [r.result for r in runs if r.variant == "checkpoint" and r.ok]
    if not ok:
        return {}
    keys = [k for k, v in ok[0].items() if k.endswith("_s") or k == "bytes"]
    return {k: statistics.median(x[k] for x in ok) for k in keys}


def targets(summaries: list[Summary], ckpt: dict[str, float], cpu: bool) -> list[dict[str, Any]]:
    """The issue's goals, each with the measured value (``None``: not measured here)."""
    s = {(x.model, x.variant): x for x in summaries}

    def ratio(model: str, variant: str, ref: str) -> float | None:
        x = s.get((model, variant))
        return None if x is None else x.ratios.get(ref)

    # A goal below 0 is an upper bound (at most |goal|); others are lower bounds.
    goals: list[tuple[str, float | None, float]] = []
    if cpu:
        for m in CPU_MODELS:
            goals.append(
                (f"{m}: defaults vs new defaults off", ratio(m, "manygpu", "manygpu_off"), 0.99)
            )
            goals.append((f"{m}: defaults vs classic", ratio(m, "manygpu", "classic"), 0.99))
    else:
        goals.append(
            ("gpt-124m: defaults vs classic", ratio("gpt-124m", "manygpu", "classic"), 6.0)
        )
        for m in GPU_MODELS:
            goals.append((f"{m}: defaults vs hand-tuned", ratio(m, "manygpu", "hand"), 1.0))
            goals.append(
                (
                    f"{m}: compile=True vs hand-tuned + compile",
                    ratio(m, "manygpu_compile", "hand_compile"),
                    1.0,
                )
            )
        goals.append(
            ("gpt-355m: fp8 vs bf16", ratio("gpt-355m", "manygpu_fp8", "manygpu_bf16"), 1.0)
        )
        x = s.get(("gpt-355m", "manygpu_compile"))
        goals.append(("gpt-355m: compile=True MFU", x.mfu if x else None, 0.40))
        goals.append(("checkpoint: async save stall (s)", ckpt.get("async_stall_s"), -1.0))
        blocking = ckpt.get("blocking_save_s"), ckpt.get("torch_save_s")
        rel = blocking[0] / blocking[1] if None not in blocking and blocking[1] else None
        goals.append(("checkpoint: blocking save / torch.save", rel, -1.1))
    out = []
    for name, value, signed in goals:
        op, goal = ("<=", -signed) if signed < 0 else (">=", signed)
        met = None if value is None else (value <= goal if op == "<=" else value >= goal)
        out.append({"target": name, "op": op, "goal": goal, "value": value, "met": met})
    return out


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render_tables(summaries: list[Summary], refs: list[str]) -> list[Table]:
    """One table per model: rate, MFU, precision used and the ratios to each reference."""
    tables = []
    for model in dict.fromkeys(x.model for x in summaries):
        rows = [x for x in summaries if x.model == model]
        unit = next((x.unit for x in rows if x.median_rate), "samples")
        table = Table(title=f"{model}: {unit}/s (median over rounds; higher is better)")
        cols = ("variant", "runs", f"{unit}/s", "MFU", "peak GB", "precision")
        for col in (*cols, *(f"x {r}" for r in refs)):
            table.add_column(col, justify="left" if col in ("variant", "precision") else "right")
        for x in rows:
            table.add_row(
                x.label,
                f"{x.runs_ok}/{x.runs}",
                _num(x.median_rate, ",.0f"),
                _num(x.mfu, ".1%"),
                _num(x.peak_memory_gb, ".1f"),
                x.precision or "—",
                *(_num(x.ratios.get(r), ".2f") for r in refs),
            )
        tables.append(table)
    return tables


def render_checkpoint(ckpt: dict[str, float], model: str) -> Table:
    table = Table(
        title=f"checkpoint of {model} + AdamW state, "
        f"{ckpt.get('bytes', 0) / 1e9:.2f} GB (median over rounds)"
    )
    for col in ("way", "save stall s", "save s", "load / resume s"):
        table.add_column(col, justify="left" if col == "way" else "right")
    table.add_row(
        "torch.save / torch.load",
        _num(ckpt.get("torch_save_s"), ".2f"),
        _num(ckpt.get("torch_save_s"), ".2f"),
        _num(ckpt.get("torch_load_s"), ".2f"),
    )
    for way in ("blocking", "async"):
        table.add_row(
            f"Checkpointer {way}",
            _num(ckpt.get(f"{way}_stall_s"), ".2f"),
            _num(ckpt.get(f"{way}_save_s"), ".2f"),
            _num(ckpt.get(f"{way}_resume_s"), ".2f"),
        )
    return table


def render_notes(report: dict[str, Any]) -> list[str]:
    cfg = report["config"]
    where = "CPU (tiny models)" if cfg["cpu"] else report["machine"].get("gpu") or "GPU"
    lines = [
        f"{where}; one process per run; {cfg['steps']} timed steps after {cfg['warmup']} "
        f"warm-up, {cfg['rounds']} interleaved round(s); AdamW lr 1e-4; synthetic data.",
        "x REF: median over rounds of this variant's rate / REF's in the same round. MFU: "
        "FLOPs per step (FlopCounterMode) x steps/s over the device's dense 16-bit peak.",
        "torch.save is not followed by fsync; Checkpointer commits its files durably.",
    ]
    if cfg["cpu"]:
        lines.append(
            "On the CPU: does any new default slow it down (manygpu vs manygpu_off and classic)? "
            "The hand-tuned variants use CUDA-only calls; the compile variants run with "
            "--variants but spend minutes compiling."
        )
    lines += [f"skipped {name}: {why}" for name, why in report["skipped"].items()]
    for t in report["targets"]:
        verdict = {True: "met", False: "[red]not met[/]", None: "not measured"}[t["met"]]
        goal = f"{t['op']} {t['goal']:g}"
        lines.append(f"target {t['target']} {goal}: {_num(t['value'], '.3f')} ({verdict})")
    return lines


# -- entry point ---------------------------------------------------------------------
FULL = {"rounds": 3, "steps": 30, "warmup": 10}
QUICK = {"rounds": 2, "steps": 5, "warmup": 3}


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cpu", action="store_true", help="tiny models on the CPU (default without CUDA)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 5 steps")
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--models", default="", help="comma list (default: the device's three or two)")
    p.add_argument("--variants", default="", help="comma list of: " + ", ".join(BY_NAME))
    p.add_argument("--batch", type=int, help="samples per step (default: each model's own)")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint row")
    p.add_argument("--ckpt-dir", default="", help="where checkpoints are written (default: TMPDIR)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--budget-s", type=float, help="start no run after this many seconds")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every run (default: torch's)")
    p.add_argument("--out", type=Path, help="JSON (default: bench/results/gpu_defaults[_cpu].json)")
    ns = p.parse_args(argv)
    import torch

    cpu = ns.cpu or not torch.cuda.is_available()
    defaults = QUICK if ns.quick else FULL
    variants = [v for v in ns.variants.split(",") if v] or list(CPU_VARIANTS if cpu else BY_NAME)
    variants.sort(key=lambda v: v != "classic")  # the baseline leads round 1
    models = tuple(m for m in ns.models.split(",") if m) or (CPU_MODELS if cpu else GPU_MODELS)
    try:
        cfg = BenchConfig(
            cpu=cpu,
            rounds=ns.rounds or defaults["rounds"],
            steps=ns.steps or defaults["steps"],
            warmup=defaults["warmup"] if ns.warmup is None else ns.warmup,
            models=models,
            variants=tuple(variants),
            batch=ns.batch,
            checkpoint=not ns.no_checkpoint,
            ckpt_dir=ns.ckpt_dir,
            run_timeout_s=ns.run_timeout,
            budget_s=ns.budget_s,
            threads=ns.threads,
        )
    except ValueError as exc:
        p.error(str(exc))
    name = "gpu_defaults_cpu.json" if cpu else "gpu_defaults.json"
    return cfg, ns.out or HERE / "results" / name


def machine_info() -> dict[str, Any]:
    import torch

    from manygpu.bench.report import machine_info as base

    info = base()
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info["cuda_runtime"] = torch.version.cuda
    return info


def run_benchmark(cfg: BenchConfig, console: Console) -> dict[str, Any]:
    """Measure every available variant; the report is data (printed only as progress)."""
    variants, skipped = split_available(cfg.variants, cfg.cpu, gpu_capability())
    runs = run_rounds(cfg, [v.name for v in variants], console)
    summaries = summarize(runs, cfg.models, variants)
    ckpt = summarize_checkpoint(runs)
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": asdict(cfg),
        "skipped": skipped,
        "summaries": [asdict(x) for x in summaries],
        "checkpoint": ckpt,
        "targets": targets(summaries, ckpt, cfg.cpu),
        "runs": [asdict(r) for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    console = Console(highlight=False, width=160)
    report = run_benchmark(cfg, console)
    summaries = [Summary(**x) for x in report["summaries"]]
    ran = {x.variant for x in summaries if x.runs_ok}
    console.print()
    for table in render_tables(summaries, [r for r in REFERENCES if r in ran]):
        console.print(table)
    if report["checkpoint"]:
        console.print(
            render_checkpoint(report["checkpoint"], CPU_MODELS[0] if cfg.cpu else "gpt-355m")
        )
    for line in render_notes(report):
        console.print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"raw results: {out}")
    return 1 if any(not r["ok"] for r in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
