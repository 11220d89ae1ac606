"""What do the always-on hang records cost? Flight Recorder + watcher thread, on vs off.

``manygpu launch`` turns on, for every worker, torch's Flight Recorder
(``TORCH_FR_BUFFER_SIZE=1000`` unless the user set it: a record of every
gloo/NCCL collective, DDP's own included) and a daemon thread
(:mod:`manygpu.launch.evidence`) that reads the recorder's counters every
0.5 s. The targets: <= 1% of a DDP step at the demo's size, and <= 2 us per
call on small collectives. This measures both, in 2-rank gloo jobs on
127.0.0.1, for these variants (:data:`VARIANTS`):

- ``off``: no Flight Recorder (``TORCH_FR_BUFFER_SIZE=0``), no watcher;
- ``on``: Flight Recorder with ``manygpu launch``'s buffer size, and the
  watcher started as the launcher's worker starts it (``evidence.start`` with
  ``MANYGPU_EVIDENCE_DIR`` set);
- ``torch`` (opt-in): ``TORCH_FR_BUFFER_SIZE`` unset, no watcher: what a plain
  ``torchrun`` worker gets. torch 2.13 records 2,000 collectives by default,
  so this is not "off";
- ``fr`` (opt-in): the Flight Recorder at 1,000 alone, to tell its share from
  the watcher's.

The recorder reads its buffer size when the process starts, so every variant
is a job of its own: two fresh rank processes
(``bench/hang_records_overhead_worker.py``, which says what they time). Each
job times, per rank: ``all_reduce`` of 4 float32 over both ranks and on a
1-rank group (wall and CPU microseconds per call), the demo's DDP step through
``Parallel(strategy="ddp")`` (milliseconds) and one watcher poll.

A job's number for a measurement is its best block (mean over the ranks):
on a shared machine the slower blocks measure other tenants, not this code;
the medians of the blocks are in the JSON too.

Jobs run interleaved: every round runs each variant once, the order rotating
from round to round (off on, on off, ...). A variant's ratio is the median over
rounds of its value over ``off``'s in the same round; its difference, the
median of the per-round differences. Both cancel drift that affects a round.

Run::

    .venv/bin/python bench/hang_records_overhead.py             # 6 rounds, ~3-4 min here
    .venv/bin/python bench/hang_records_overhead.py --quick     # smoke run, ~40 s

Results: a table on stdout and JSON (default
``bench/results/hang_records_overhead.json``) with the command, the machine
(CPUs, load average before and after), the date, torch's version and every
job's numbers.
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

# Next to this file (python puts the script's folder on sys.path).
import overhead_common as common
from hang_records_overhead_worker import WorkerConfig

HERE = Path(__file__).resolve().parent
WORKER = HERE / "hang_records_overhead_worker.py"
BASELINE = "off"


@dataclass(frozen=True)
class Variant:
    """One setting of the two switches."""

    fr_buffer: str | None
    """``TORCH_FR_BUFFER_SIZE`` of the ranks; ``None``: unset (torch's default); "launch":
    what ``manygpu launch`` sets."""
    watcher: bool
    """Start :func:`manygpu.launch.evidence.start`'s thread."""
    label: str


VARIANTS = {
    "off": Variant("0", False, "no recorder, no watcher"),
    "torch": Variant(None, False, "torch's default recorder, no watcher"),
    "fr": Variant("launch", False, "manygpu's recorder, no watcher"),
    "on": Variant("launch", True, "manygpu launch: recorder + watcher"),
}
METRICS = {
    "allreduce_us": "all_reduce 2 ranks (us/call)",
    "allreduce_cpu_us": "all_reduce 2 ranks, CPU (us/call)",
    "solo_us": "all_reduce 1 rank (us/call)",
    "solo_cpu_us": "all_reduce 1 rank, CPU (us/call)",
    "step_ms": "DDP step, demo size (ms)",
}
"""What every job measures (keys of a job's ``metrics``) and how the table names it."""
TARGET_STEP_RATIO = 1.01
TARGET_CALL_US = 2.0


@dataclass(frozen=True, kw_only=True)
class Config:
    """What to measure and how often."""

    rounds: int
    """Rounds; each runs every variant once, as a job of its own."""
    iters: int
    """``all_reduce`` calls per timed block over 2 ranks."""
    solo_iters: int
    """``all_reduce`` calls per timed block on a 1-rank group."""
    steps: int
    """DDP steps per timed block."""
    blocks: int
    """Timed blocks of each measurement per job (a job reports the best, and the median)."""
    warmup: int
    """Untimed DDP steps (and ``iters`` untimed calls) before the blocks."""
    variants: tuple[str, ...]
    """Variants asked for, ``off`` first."""
    job_timeout_s: float
    """A job taking longer is killed and recorded as failed."""

    def __post_init__(self) -> None:
        for name in ("rounds", "iters", "solo_iters", "steps", "blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or BASELINE not in self.variants:
            raise ValueError(f"--variants: choose from {list(VARIANTS)}, with {BASELINE!r}")


@dataclass
class JobRecord:
    """One job (two ranks) of one variant: the raw data."""

    round: int
    """1-based."""
    position: int
    """Place of this job within its round (0 = first)."""
    variant: str
    ok: bool
    wall_s: float
    """Whole job, start-up included."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Mean over ranks of each rank's best block (keys of :data:`METRICS`): the
    other blocks add other tenants' interference, not this code's cost."""
    metrics_median: dict[str, float] = field(default_factory=dict)
    """The same with each rank's median block."""
    poll_us: float | None = None
    """One watcher poll (``evidence.fr_status``), mean over ranks."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's blocks and what it saw of the recorder and the watcher."""
    error: str | None = None


@dataclass
class Comparison:
    """One variant against a baseline (``off``) on one metric, over the rounds."""

    variant: str
    baseline: str
    metric: str
    median: float | None
    """Median over rounds of the variant's own value."""
    ratio: float | None
    """Median over rounds of value / off's value in that round."""
    diff: float | None
    """Median over rounds of value - off's value in that round (the metric's unit)."""
    diff_se: float | None
    """Standard error of ``diff``, from the rounds' spread (1.25 x 1.48 x MAD / sqrt(n))."""
    ratio_se: float | None
    """The same for ``ratio``."""
    slower_rounds: int
    """Rounds in which the variant was slower than ``off``."""
    rounds: int
    per_round_ratios: list[float] = field(default_factory=list)


@dataclass
class Report:
    """Everything a run of this benchmark produced."""

    command: str
    date: str
    machine: dict[str, Any]
    config: Config
    jobs: list[JobRecord]
    comparisons: list[Comparison]
    targets: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- driver: jobs, rounds ---------------------------------------------------------------
def job_env(variant: str, rank: int, port: int, evidence_dir: Path) -> dict[str, str]:
    """A rank's environment: a start by hand on loopback, 1 thread, the variant's switches."""
    from manygpu.launch.agent import FLIGHT_RECORDS  # what manygpu launch sets
    from manygpu.runtime import env as envmod

    env = common.loopback_env(os.environ, rank, port)
    for name in (envmod.FLIGHT_RECORDER, envmod.EVIDENCE_DIR):
        env.pop(name, None)  # "off" is off even if the caller's shell set them
    switches = VARIANTS[variant]
    if switches.fr_buffer is not None:
        launch = switches.fr_buffer == "launch"
        env[envmod.FLIGHT_RECORDER] = str(FLIGHT_RECORDS) if launch else switches.fr_buffer
    if switches.watcher:
        env[envmod.EVIDENCE_DIR] = str(evidence_dir)
    return env


def run_job(cfg: Config, variant: str, round_: int, position: int, tmp: Path) -> JobRecord:
    """Start both ranks of one variant, wait, read what rank 0 wrote."""
    out = tmp / f"{variant}-r{round_}.json"
    where = tmp / f"evidence-{variant}-r{round_}"
    where.mkdir()
    port = common.free_port()
    cmd = [sys.executable, str(WORKER), "--config", json.dumps(asdict(WorkerConfig.pick(cfg)))]
    envs = [job_env(variant, rank, port, where) for rank in range(2)]
    run = common.run_ranks([*cmd, "--out", str(out)], envs, cfg.job_timeout_s)
    if any(run.codes) or not out.exists():
        tails = [
            f"[rank{r}] exit {c}: " + " | ".join(o.strip().splitlines()[-3:])
            for r, (c, o) in enumerate(zip(run.codes, run.outputs, strict=True))
        ]
        return JobRecord(round_, position, variant, False, run.wall_s, error="\n".join(tails))
    ranks = json.loads(out.read_text())
    best = {k: statistics.mean(min(r["blocks"][k]) for r in ranks) for k in METRICS}
    mid = {k: statistics.mean(statistics.median(r["blocks"][k]) for r in ranks) for k in METRICS}
    poll = statistics.mean(r["poll_us"] for r in ranks)
    return JobRecord(round_, position, variant, True, run.wall_s, best, mid, poll, ranks)


def progress_line(cfg: Config, job: JobRecord) -> str:
    head = f"round {job.round}/{cfg.rounds}  {job.variant:<5}"
    if not job.ok:
        return f"{head} failed ({job.wall_s:.1f} s): {job.error}"
    m, ranks = job.metrics, job.ranks
    proof = (
        f"fr entries {ranks[0]['fr_entries']}, "
        f"watcher {'alive' if all(r['watcher_alive'] for r in ranks) else 'none'}"
    )
    return (
        f"{head} all_reduce {m['allreduce_us']:7.1f} us  1-rank {m['solo_us']:5.1f} us "
        f"(CPU {m['solo_cpu_us']:5.1f})  "
        f"step {m['step_ms']:6.2f} ms  ({proof}; job {job.wall_s:.1f} s)"
    )


def run_rounds(cfg: Config) -> list[JobRecord]:
    """All jobs, interleaved: round 1 runs every variant, then round 2, ..."""
    jobs: list[JobRecord] = []
    with tempfile.TemporaryDirectory(prefix="hang_records-") as tmp:
        for round_ in range(cfg.rounds):
            for position, variant in enumerate(common.round_order(list(cfg.variants), round_)):
                job = run_job(cfg, variant, round_ + 1, position, Path(tmp))
                jobs.append(job)
                print(progress_line(cfg, job), flush=True)
    return jobs


# -- summarising (data) and showing (views) -------------------------------------------
def compare(
    jobs: list[JobRecord], variants: tuple[str, ...], baseline: str = BASELINE
) -> list[Comparison]:
    """Every variant against ``baseline``, metric by metric, paired by round."""
    base = {j.round: j.metrics for j in jobs if j.variant == baseline and j.ok}
    out = []
    for variant in variants:
        mine = [j for j in jobs if j.variant == variant and j.ok]
        for key in METRICS:
            values = [j.metrics[key] for j in mine]
            pairs = [(j.metrics[key], base[j.round][key]) for j in mine if j.round in base]
            ratios = [v / b for v, b in pairs]
            diffs = [v - b for v, b in pairs]
            out.append(
                Comparison(
                    variant=variant,
                    baseline=baseline,
                    metric=key,
                    median=statistics.median(values) if values else None,
                    ratio=statistics.median(ratios) if ratios else None,
                    diff=statistics.median(diffs) if diffs else None,
                    diff_se=common.median_se(diffs),
                    ratio_se=common.median_se(ratios),
                    slower_rounds=sum(d > 0 for d in diffs),
                    rounds=len(pairs),
                    per_round_ratios=ratios,
                )
            )
    return out


def judge(comparisons: list[Comparison], jobs: list[JobRecord]) -> dict[str, Any]:
    """The issue's targets for ``on``, each met / NOT met / unresolved by this run's noise.

    ``step_ratio_from_calls`` is the DDP step's overhead predicted from the
    1-rank per-call CPU cost and the collectives a step issues: a bound that the
    step's own noise cannot blur.
    """
    on = {c.metric: c for c in comparisons if c.variant == "on" and c.baseline == BASELINE}
    step, duo, solo = on.get("step_ms"), on.get("allreduce_us"), on.get("solo_us")
    cpu = on.get("solo_cpu_us")
    per_step = [
        r["collectives_per_step"]
        for j in jobs
        if j.ok and j.variant == "on"
        for r in j.ranks
        if r["collectives_per_step"] is not None
    ]
    predicted = None
    if cpu and cpu.diff is not None and step and step.median and per_step:
        predicted = 1 + cpu.diff * statistics.median(per_step) / (step.median * 1e3)
    return {
        "step_ratio_max": TARGET_STEP_RATIO,
        "step_ratio": step.ratio if step else None,
        "step_ratio_se": step.ratio_se if step else None,
        "step": common.verdict(step.ratio, step.ratio_se, TARGET_STEP_RATIO) if step else None,
        "collectives_per_step": statistics.median(per_step) if per_step else None,
        "step_ratio_from_calls": predicted,
        "call_us_max": TARGET_CALL_US,
        "call_us_2_ranks": duo.diff if duo else None,
        "call_us_2_ranks_se": duo.diff_se if duo else None,
        "call_2_ranks": common.verdict(duo.diff, duo.diff_se, TARGET_CALL_US) if duo else None,
        "call_us_1_rank": solo.diff if solo else None,
        "call_us_1_rank_se": solo.diff_se if solo else None,
        "call_1_rank": common.verdict(solo.diff, solo.diff_se, TARGET_CALL_US) if solo else None,
        "call_us_1_rank_cpu": cpu.diff if cpu else None,
        "call_us_1_rank_cpu_se": cpu.diff_se if cpu else None,
        "call_1_rank_cpu": common.verdict(cpu.diff, cpu.diff_se, TARGET_CALL_US) if cpu else None,
    }


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _se(se: float | None, spec: str) -> str:
    return "" if se is None else f" ± {format(se, spec)}"


def render_table(report: Report) -> list[str]:
    """The comparisons as a markdown table (also what BENCHMARKS.md shows)."""
    lines = [
        "| measurement | variant | median | ratio (median of rounds) | difference | slower |",
        "|---|---|---:|---:|---:|---:|",
    ]
    order = list(METRICS)
    for c in sorted(report.comparisons, key=lambda c: order.index(c.metric)):
        unit = "ms" if c.metric == "step_ms" else "us"
        if c.variant == c.baseline:
            lines.append(f"| {METRICS[c.metric]} | {c.variant} | {_num(c.median, ',.2f')} | | | |")
            continue
        lines.append(
            f"| {METRICS[c.metric]} | {c.variant} vs {c.baseline} | {_num(c.median, ',.2f')} | "
            f"{_num(c.ratio, '.4f')}{_se(c.ratio_se, '.4f')} | "
            f"{_num(c.diff, '+.2f')}{_se(c.diff_se, '.2f')} {unit} | "
            f"{c.slower_rounds}/{c.rounds} |"
        )
    polls = [j.poll_us for j in report.jobs if j.ok and j.poll_us is not None]
    if polls:
        poll = statistics.median(polls)
        lines.append(
            f"\nOne watcher poll (counter read): {poll:.1f} us, every 0.5 s = "
            f"{poll / 5e3:.4f}% of a core."
        )
    return lines


def render_verdict(report: Report) -> list[str]:
    """The targets, each with its value, its standard error and the verdict."""
    t = report.targets

    def pm(se: float | None, spec: str) -> str:
        return "" if se is None else f" +- {format(se, spec)}"

    return [
        f"target: DDP step on/off <= {t['step_ratio_max']}: {_num(t['step_ratio'], '.4f')}"
        f"{pm(t['step_ratio_se'], '.4f')} -> {t['step']}; predicted from the 1-rank CPU "
        f"cost x {_num(t['collectives_per_step'], '.1f')} collectives/step: "
        f"{_num(t['step_ratio_from_calls'], '.5f')}",
        f"target: <= {t['call_us_max']} us per small call: 2 ranks "
        f"{_num(t['call_us_2_ranks'], '+.2f')}{pm(t['call_us_2_ranks_se'], '.2f')} us -> "
        f"{t['call_2_ranks']}; 1 rank {_num(t['call_us_1_rank'], '+.2f')}"
        f"{pm(t['call_us_1_rank_se'], '.2f')} us -> {t['call_1_rank']}; 1 rank CPU "
        f"{_num(t['call_us_1_rank_cpu'], '+.2f')}{pm(t['call_us_1_rank_cpu_se'], '.2f')} us -> "
        f"{t['call_1_rank_cpu']}",
    ]


# -- entry point ------------------------------------------------------------------------
FULL = {"rounds": 6, "iters": 100, "solo_iters": 1000, "steps": 10, "blocks": 8, "warmup": 10}
QUICK = {"rounds": 2, "iters": 100, "solo_iters": 500, "steps": 5, "blocks": 3, "warmup": 3}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Config]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 short rounds")
    p.add_argument("--rounds", type=int, help=f"default {FULL['rounds']}")
    p.add_argument("--iters", type=int, help=f"calls per block, 2 ranks; default {FULL['iters']}")
    p.add_argument("--solo-iters", type=int, help=f"calls per block, 1 rank; {FULL['solo_iters']}")
    p.add_argument("--steps", type=int, help=f"DDP steps per block; default {FULL['steps']}")
    p.add_argument("--blocks", type=int, help=f"timed blocks per measurement; {FULL['blocks']}")
    p.add_argument("--warmup", type=int, help=f"untimed DDP steps; default {FULL['warmup']}")
    p.add_argument("--variants", default="off,on", help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--job-timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--out", type=Path, default=HERE / "results" / "hang_records_overhead.json")
    ns = p.parse_args(argv)
    defaults = QUICK if ns.quick else FULL
    names = [n.strip() for n in ns.variants.split(",") if n.strip()]
    names.sort(key=lambda n: n != BASELINE)  # stable: off leads round 1
    try:
        return ns, Config(
            **{k: v if getattr(ns, k) is None else getattr(ns, k) for k, v in defaults.items()},
            variants=tuple(dict.fromkeys(names)),
            job_timeout_s=ns.job_timeout,
        )
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    ns, cfg = parse_args(argv)
    machine = common.machine_info()
    jobs = run_rounds(cfg)
    machine["load_average_after"] = list(os.getloadavg())
    comparisons = compare(jobs, cfg.variants)
    if "torch" in cfg.variants:  # what manygpu launch adds over a plain torchrun worker
        comparisons += compare(jobs, ("on",), baseline="torch")
    report = Report(
        command=shlex.join([sys.executable, *sys.argv]),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine=machine,
        config=cfg,
        jobs=jobs,
        comparisons=comparisons,
        targets=judge(comparisons, jobs),
    )
    print()
    print("\n".join(render_table(report)))
    print("\n".join(render_verdict(report)))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    print(f"raw results: {ns.out}")
    return 1 if any(not j.ok for j in jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
