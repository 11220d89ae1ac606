"""What do the default-on straggler reports cost a training step? ``stragglers`` off vs on.

``Parallel`` reports every rank's step split to the main rank by default
(``stragglers=True``: every 50 steps). The training thread pays a few timer
reads per step (:class:`manygpu.observe.step_clock.StepClock`), one read of DDP's
reducer timers every ``every // 10`` steps (DDP's runtime-stats sampling runs at
that rate instead of its default 100) and a queue put per window; a daemon
thread does the store I/O (:mod:`manygpu.observe.straggler_board`). Target: <= 0.5%
of a step at the demo's size. Measured two ways:

- **end to end**: 2-rank gloo jobs on 127.0.0.1 (1 thread a rank, started by hand on
  a free port; ``bench/straggler_overhead_worker.py``) training ``manygpu demo``'s
  SimpleCNN on 16x16 digits through ``Parallel(strategy="ddp")``, ``par.prepare``,
  ``par.backward``, AdamW and a prepared ``DataLoader`` (32 samples per rank), for
  ``off`` (``stragglers=False``), ``on`` (``True``: every 50) and ``on-10`` (every
  10). Per job: warm-up, then the median (and mean) of >= 200 timed steps, several
  report windows. Rounds run every variant once, the order rotating from round to
  round; a ratio is the median over rounds of step / ``off``'s step in that round,
  with a standard error from the rounds' spread;
- **the training thread alone**, in this process, free of the other rank's noise:
  ns per step of ``StepClock.waited_for_input`` + ``step`` over a million calls (no-op
  sink, a probe returning ``None``), plus the probe's real cost (timed in the jobs)
  every ``probe_every`` steps: a bound on the thread's share that step noise cannot blur.

Run::

    .venv/bin/python bench/straggler_overhead.py            # 8 rounds, ~7 min here
    .venv/bin/python bench/straggler_overhead.py --quick    # smoke run, ~1 min

Results: a markdown table and the verdict on stdout; JSON (default
``bench/results/straggler_overhead.json``) with the command, machine, date and every job.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Shared with the Flight Recorder's benchmark, next to this file.
import overhead_common as common

HERE = Path(__file__).resolve().parent
WORKER = HERE / "straggler_overhead_worker.py"
BASELINE = "off"
VARIANTS: dict[str, bool | int] = {"off": False, "on": True, "on-10": 10}
"""Variant -> ``Parallel(stragglers=...)``."""
EVERY = {"on": 50, "on-10": 10}
"""Steps per report of the reporting variants (``True`` is the default 50)."""
TARGET_RATIO = 1.005


@dataclass(frozen=True, kw_only=True)
class Config:
    """What to measure and how often."""

    rounds: int
    """Rounds; each runs every variant once, as a 2-rank job of its own."""
    warmup: int
    """Untimed steps per job."""
    steps: int
    """Timed steps per job (>= 200 in a full run: several windows of 50)."""
    probe_calls: int
    """Reads of DDP's reducer timers timed per rank after training."""
    clock_calls: int
    """Calls of the clock per setting in the in-process measurement."""
    job_timeout_s: float
    """A job taking longer is killed (both ranks) and recorded as failed."""

    def __post_init__(self) -> None:
        for name in ("rounds", "warmup", "steps", "clock_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


@dataclass
class JobRecord:
    """One job (two ranks) of one variant; step times are means over the two ranks."""

    round: int
    position: int
    variant: str
    ok: bool
    wall_s: float
    median_ms: float = 0.0  # each rank's median step (the ranks run in lockstep)
    mean_ms: float = 0.0  # each rank's mean step: rare slow steps included, as throughput sees
    windows_judged: int = 0  # windows the main rank collected from both ranks (0 when off)
    straggler_lines: int = 0  # "manygpu: straggler:" verdicts printed (the ranks are alike)
    probe_us: float | None = None  # one read of DDP's reducer timers
    final_loss: float | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


@dataclass
class Comparison:
    """One variant against ``off``, paired by round: medians of the per-round ratios."""

    variant: str
    jobs: int
    median_ms: float
    mean_ms: float
    ratio: float | None
    ratio_se: float | None
    mean_ratio: float | None
    mean_ratio_se: float | None
    slower_rounds: int
    per_round_ratios: list[float] = field(default_factory=list)


# -- jobs -------------------------------------------------------------------------------
def job_env(rank: int, port: int) -> dict[str, str]:
    """A rank's environment: started by hand on loopback, 1 thread, CPU only."""
    env = {k: v for k, v in os.environ.items() if k != "MANYGPU_STRAGGLERS"}  # the variant rules
    return common.loopback_env(env, rank, port)


def run_job(cfg: Config, variant: str, round_: int, position: int, tmp: Path) -> JobRecord:
    """Start both ranks, wait (killing both past the timeout), read what each wrote."""
    out = tmp / f"{variant}-r{round_}"
    out.mkdir()
    job = {"stragglers": VARIANTS[variant], "warmup": cfg.warmup, "steps": cfg.steps}
    job["probe_calls"] = cfg.probe_calls
    cmd = [sys.executable, str(WORKER), "--config", json.dumps(job), "--out", str(out)]
    port = common.free_port()
    run = common.run_ranks(cmd, [job_env(r, port) for r in range(2)], cfg.job_timeout_s)
    outputs, codes, timed_out, wall = run.outputs, run.codes, run.timed_out, run.wall_s
    files = [out / f"rank{r}.json" for r in range(2)]
    if timed_out or any(codes) or not all(f.exists() for f in files):
        why = f"timed out after {cfg.job_timeout_s:.0f} s" if timed_out else f"exit {codes}"
        tails = [" | ".join(o.strip().splitlines()[-3:]) for o in outputs]
        return JobRecord(round_, position, variant, False, wall, error=f"{why}: {tails}")
    ranks = [json.loads(f.read_text()) for f in files]
    probes = [r["probe_us"] for r in ranks if r["probe_us"] is not None]
    return JobRecord(
        round_, position, variant, True, wall,
        median_ms=statistics.fmean(r["median_ms"] for r in ranks),
        mean_ms=statistics.fmean(r["mean_ms"] for r in ranks),
        windows_judged=ranks[0]["windows_judged"],
        straggler_lines=sum(o.count("manygpu: straggler:") for o in outputs),
        probe_us=statistics.fmean(probes) if probes else None,
        final_loss=ranks[0]["final_loss"],
        ranks=[{k: v for k, v in r.items() if k != "last_window"} for r in ranks],
    )  # fmt: skip


def run_rounds(cfg: Config) -> list[JobRecord]:
    jobs: list[JobRecord] = []
    with tempfile.TemporaryDirectory(prefix="straggler_overhead-") as tmp:
        for round_ in range(cfg.rounds):
            for position, variant in enumerate(common.round_order(list(VARIANTS), round_)):
                job = run_job(cfg, variant, round_ + 1, position, Path(tmp))
                jobs.append(job)
                head = f"round {job.round}/{cfg.rounds}  {job.variant:<6}"
                print(
                    f"{head} failed ({job.wall_s:.1f} s): {job.error}"
                    if not job.ok
                    else f"{head} median step {job.median_ms:6.2f} ms  mean {job.mean_ms:6.2f}"
                    f" ms  windows {job.windows_judged}  probe {job.probe_us or 0:5.1f} us  "
                    f"loss {job.final_loss:.4f}  (job {job.wall_s:.1f} s)",
                    flush=True,
                )
    return jobs


# -- summarising and showing --------------------------------------------------------------
def verdict(value: float | None, se: float | None, limit: float) -> str:
    """``met`` / ``not met`` when two standard errors settle it, else say the noise won."""
    return common.verdict(
        value, se, limit, not_met="not met", unresolved="not resolved by this machine's noise"
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def compare(jobs: list[JobRecord]) -> list[Comparison]:
    base = {j.round: j for j in jobs if j.variant == BASELINE and j.ok}
    out = []
    for variant in VARIANTS:
        mine = [j for j in jobs if j.variant == variant and j.ok]
        pairs = [(j, base[j.round]) for j in mine if j.round in base]
        ratios = [j.median_ms / b.median_ms for j, b in pairs]
        means = [j.mean_ms / b.mean_ms for j, b in pairs]
        out.append(
            Comparison(
                variant, len(mine),
                _median([j.median_ms for j in mine]) or 0.0,
                _median([j.mean_ms for j in mine]) or 0.0,
                _median(ratios), common.median_se(ratios), _median(means), common.median_se(means),
                sum(r > 1 for r in ratios), ratios,
            )
        )  # fmt: skip
    return out


def judge(comparisons: list[Comparison], jobs: list[JobRecord], clock: list[dict[str, float]]
          ) -> dict[str, Any]:  # fmt: skip
    """Each reporting variant against the target, measured; and the training thread's
    bound: the clock's ns per step + the probe's cost / ``probe_every``, over ``off``'s step."""
    off = next((c for c in comparisons if c.variant == BASELINE), None)
    costs = {int(c["every"]): c for c in clock}
    out: dict[str, Any] = {"ratio_max": TARGET_RATIO}
    for c in comparisons:
        if c.variant == BASELINE:
            continue
        cost = costs.get(EVERY[c.variant])
        probe = _median([j.probe_us for j in jobs if j.variant == c.variant and j.probe_us])
        bound = None
        if off and off.median_ms and cost and probe is not None:  # ns per step / off's step
            ns = cost["ns_per_step"] + probe * 1e3 / cost["probe_every"]
            bound = 1 + ns / (off.median_ms * 1e6)
        out[c.variant] = {
            "every": EVERY[c.variant],
            "probe_every": cost["probe_every"] if cost else None,
            "ratio": c.ratio, "ratio_se": c.ratio_se,
            "verdict": verdict(c.ratio, c.ratio_se, TARGET_RATIO),
            "mean_ratio": c.mean_ratio, "mean_ratio_se": c.mean_ratio_se,
            "mean_verdict": verdict(c.mean_ratio, c.mean_ratio_se, TARGET_RATIO),
            "probe_us": probe,
            "thread_bound_ratio": bound,
            "thread_bound_verdict": verdict(bound, 0.0, TARGET_RATIO) if bound else None,
        }  # fmt: skip
    return out


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pm(value: float | None, se: float | None, spec: str) -> str:
    return _num(value, spec) + ("" if se is None else f" ± {format(se, spec)}")


def render_table(report: dict[str, Any]) -> list[str]:
    """The comparison as markdown tables (what BENCHMARKS.md shows)."""
    lines = [
        "| variant | stragglers | jobs | median step | mean step | median / off | mean / off "
        "| slower | windows |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["comparisons"]:
        w = [j.windows_judged for j in report["jobs"] if j.ok and j.variant == c.variant]
        ratios = ("", "", "") if c.variant == BASELINE else (
            _pm(c.ratio, c.ratio_se, ".4f"), _pm(c.mean_ratio, c.mean_ratio_se, ".4f"),
            f"{c.slower_rounds}/{len(c.per_round_ratios)}",
        )  # fmt: skip
        lines.append(
            f"| {c.variant} | {VARIANTS[c.variant]} | {c.jobs} | {_num(c.median_ms, '.2f')} ms "
            f"| {_num(c.mean_ms, '.2f')} ms | {' | '.join(ratios)} | "
            f"{min(w, default=0)}-{max(w, default=0)} |"
        )
    lines += ["", "| training thread, in-process | every | probe every | ns per step |"]
    lines.append("|---|---:|---:|---:|")
    for c in report["clock"]:
        lines.append(
            f"| StepClock.waited_for_input + step, {c['calls']:,} calls | {c['every']} | "
            f"{c['probe_every']} | {c['ns_per_step']:,.0f} |"
        )
    return lines


def render_verdict(report: dict[str, Any]) -> list[str]:
    t = report["targets"]
    return [
        f"target {name} (every {v['every']}): median step / off <= {t['ratio_max']}: "
        f"{_pm(v['ratio'], v['ratio_se'], '.4f')} -> {v['verdict']}; mean step "
        f"{_pm(v['mean_ratio'], v['mean_ratio_se'], '.4f')} -> {v['mean_verdict']}; "
        f"training-thread bound (clock + {_num(v['probe_us'], '.1f')} us probe every "
        f"{v['probe_every']} steps): {_num(v['thread_bound_ratio'], '.5f')} -> "
        f"{v['thread_bound_verdict']}"
        for name, v in t.items()
        if isinstance(v, dict)
    ]


# -- entry point ----------------------------------------------------------------------------
FULL = {"rounds": 8, "warmup": 30, "steps": 250, "probe_calls": 500, "clock_calls": 1_000_000}
QUICK = {"rounds": 2, "warmup": 5, "steps": 40, "probe_calls": 100, "clock_calls": 100_000}


def parse_args(argv: list[str] | None = None) -> tuple[Config, Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 short rounds")
    for name, value in FULL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {value:,}")
    p.add_argument("--job-timeout", type=float, default=180.0, help="seconds per job")
    p.add_argument("--out", type=Path, default=HERE / "results" / "straggler_overhead.json")
    ns = p.parse_args(argv)
    defaults = QUICK if ns.quick else FULL
    try:
        cfg = Config(
            **{k: v if getattr(ns, k) is None else getattr(ns, k) for k, v in defaults.items()},
            job_timeout_s=ns.job_timeout,
        )
    except ValueError as exc:
        p.error(str(exc))
    return cfg, ns.out


def main(argv: list[str] | None = None) -> int:
    from straggler_overhead_worker import clock_cost  # next to this file

    cfg, out = parse_args(argv)
    machine, started = common.machine_info(), dt.datetime.now(dt.timezone.utc)
    # The thread's own cost first, while no job runs beside it.
    clock = [clock_cost(cfg.clock_calls, every) for every in (50, 10)]
    for c in clock:
        print(f"clock every {c['every']}: {c['ns_per_step']:,.0f} ns per step", flush=True)
    jobs = run_rounds(cfg)
    machine["load_average_after"] = list(os.getloadavg())
    comparisons = compare(jobs)
    report: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": started.isoformat(timespec="seconds"),
        "machine": machine,
        "config": cfg,
        "clock": clock,
        "jobs": jobs,
        "comparisons": comparisons,
        "targets": judge(comparisons, jobs, clock),
    }
    print()
    print("\n".join(render_table(report)))
    print("\n".join(render_verdict(report)))
    serial = dict(report, config=asdict(cfg), jobs=[asdict(j) for j in jobs])
    serial["comparisons"] = [asdict(c) for c in comparisons]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(serial, indent=2) + "\n")
    print(f"raw results: {out}")
    return 1 if any(not j.ok for j in jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
