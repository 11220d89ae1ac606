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
is a job of its own: two fresh worker processes (this script with
``--worker``). Each job times, per rank:

- ``all_reduce 2 ranks``: microseconds per ``all_reduce`` of 4 float32 over
  both ranks (blocks of ``--iters`` calls, a barrier before each block);
- ``all_reduce 1 rank``: the same call on a group of one rank (each rank its
  own, timed one rank at a time): no peer to wait for, so the recorder's own
  per-call cost is not lost in loopback latency of a millisecond or more;
- ``DDP step``: seconds per training step of the demo (``manygpu demo``'s
  SimpleCNN on 16x16 digits, Adam, 32 samples per rank = its global batch of
  64 on 2 workers) through ``Parallel(strategy="ddp")``, in blocks of
  ``--steps`` steps;
- ``counter read``: microseconds of one watcher poll (``evidence.fr_status``),
  which the watcher pays twice a second.

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
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
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


# -- worker: one rank of one job ------------------------------------------------------
def _timed_blocks(
    fn: Callable[[], None], count: int, blocks: int, sync: Callable[[], None]
) -> list[float]:
    """Seconds per call of ``fn``, one value per block of ``count`` calls."""
    return [wall for wall, _ in _timed_blocks_cpu(fn, count, blocks, sync)]


def _timed_blocks_cpu(
    fn: Callable[[], None], count: int, blocks: int, sync: Callable[[], None]
) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds per call of ``fn``, one pair per block of ``count`` calls.

    The CPU time is every thread of this process (gloo's worker and the
    watcher included): what the call costs, without the waits that make its
    wall time swing with the machine's load.
    """
    out = []
    for _ in range(blocks):
        sync()  # both ranks start a block together
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            fn()
        out.append(((time.perf_counter() - start) / count, (time.process_time() - cpu) / count))
    return out


def _nothing() -> None:
    pass


def _ddp_step(image_size: int, batch: int, seed: int) -> tuple[Callable[[], None], Any]:
    """The demo's training step through ``Parallel(strategy="ddp")``; (step, Parallel)."""
    import torch
    import torch.nn.functional as F

    from manygpu import Parallel
    from manygpu.demo.data import digits
    from manygpu.demo.model import SimpleCNN

    par = Parallel(strategy="ddp", precision="fp32")  # as manygpu demo
    torch.manual_seed(0)
    model = SimpleCNN(image_size)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)  # the demo's optimizer and rate
    model, opt = par.prepare(model, opt)
    images, labels = digits(image_size)[0].tensors
    gen = torch.Generator().manual_seed(seed)
    # Batches drawn up front: the loader is not what is measured.
    batches = [
        (images[i], labels[i])
        for i in (torch.randint(len(labels), (batch,), generator=gen) for _ in range(64))
    ]
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        par.backward(loss)
        opt.step()

    return step, par


def _collectives_per_step(step: Callable[[], None], steps: int) -> float | None:
    """Collectives a DDP step issues, from the recorder's counters (``None`` with it off)."""
    from manygpu.launch import evidence

    def enqueued() -> int | None:
        status = evidence.fr_status()
        if not status:
            return None
        return sum(int(c.get("last_enqueued_collective", 0)) for c in status.values())

    before = enqueued()
    for _ in range(steps):
        step()
    after = enqueued()
    return None if before is None or after is None else (after - before) / steps


def _recorder_facts(watcher: Any) -> dict[str, Any]:
    """What this rank's Flight Recorder holds and whether its watcher runs: proof of the variant."""
    from manygpu.launch import evidence

    entries = evidence.fr_records().get("entries", [])
    polls = []
    for _ in range(200):
        start = time.perf_counter()
        evidence.fr_status()
        polls.append(time.perf_counter() - start)
    return {
        "fr_buffer_size": os.environ.get("TORCH_FR_BUFFER_SIZE"),
        "fr_entries": len(entries),
        "fr_last_op": entries[-1].get("profiling_name") if entries else None,
        "watcher_alive": bool(watcher is not None and watcher.is_alive()),
        "poll_us": statistics.median(polls) * 1e6,
    }


def _time_small_calls(cfg: Config, rank: int, world: int) -> dict[str, list[float]]:
    """Microseconds per ``all_reduce`` of 4 float32, per block: over both ranks, and alone."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(4)

    def call() -> None:
        dist.all_reduce(tensor)

    _timed_blocks(call, cfg.iters, 1, dist.barrier)  # warm-up
    duo = _timed_blocks_cpu(call, cfg.iters, cfg.blocks, dist.barrier)
    solo_group, _ = dist.new_subgroups(group_size=1)  # every rank its own group

    def solo_call() -> None:
        dist.all_reduce(tensor, group=solo_group)

    # One rank at a time (the other waits in a barrier, off the CPU), so the
    # two ranks' loops do not compete for the 2 cores.
    solo: list[tuple[float, float]] = []
    for turn in range(world):
        if turn == rank:
            _timed_blocks(solo_call, cfg.solo_iters, 1, _nothing)
            solo = _timed_blocks_cpu(solo_call, cfg.solo_iters, cfg.blocks, _nothing)
        dist.barrier()
    return {
        "allreduce_us": [w * 1e6 for w, _ in duo],
        "allreduce_cpu_us": [c * 1e6 for _, c in duo],
        "solo_us": [w * 1e6 for w, _ in solo],
        "solo_cpu_us": [c * 1e6 for _, c in solo],
    }


def worker_main(cfg: Config, out: Path) -> None:
    """One rank: start the watcher if this variant has it, then time everything."""
    import torch.distributed as dist

    from manygpu.launch import evidence

    # Before the process group, as manygpu's launched worker does it (launch/worker.py).
    watcher = evidence.start(os.environ)
    step, par = _ddp_step(image_size=16, batch=32, seed=int(os.environ["RANK"]))
    with par:
        blocks = _time_small_calls(cfg, par.rank, par.world_size)
        _timed_blocks(step, cfg.warmup, 1, dist.barrier)
        per_step = _collectives_per_step(step, cfg.warmup)
        step_s = _timed_blocks(step, cfg.steps, cfg.blocks, dist.barrier)
        blocks["step_ms"] = [s * 1e3 for s in step_s]
        mine = {"rank": par.rank, "blocks": blocks, "collectives_per_step": per_step}
        mine.update(_recorder_facts(watcher))
        everyone: list[Any] = [None] * par.world_size
        dist.all_gather_object(everyone, mine)
        if par.rank == 0:
            out.write_text(json.dumps(everyone))


# -- driver: jobs, rounds ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(variant: str, rank: int, port: int, evidence_dir: Path) -> dict[str, str]:
    """A rank's environment: a start by hand on loopback, 1 thread, the variant's switches."""
    from manygpu.launch.agent import FLIGHT_RECORDS  # what manygpu launch sets
    from manygpu.runtime import env as envmod

    env = dict(os.environ)
    for name in (envmod.FLIGHT_RECORDER, envmod.EVIDENCE_DIR):
        env.pop(name, None)  # "off" is off even if the caller's shell set them
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
    )  # fmt: skip
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
    port = _free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(asdict(cfg))]
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [*cmd, "--out", str(out)],
            env=job_env(variant, rank, port, where),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs, codes = [], []
    deadline = start + cfg.job_timeout_s
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()  # our own children, by handle
            outputs.append(proc.communicate()[0])
        codes.append(proc.returncode)
    wall = time.perf_counter() - start
    if any(codes) or not out.exists():
        tails = [
            f"[rank{r}] exit {c}: " + " | ".join(o.strip().splitlines()[-3:])
            for r, (c, o) in enumerate(zip(codes, outputs, strict=True))
        ]
        return JobRecord(round_, position, variant, False, wall, error="\n".join(tails))
    ranks = json.loads(out.read_text())
    best = {key: statistics.mean(min(r["blocks"][key]) for r in ranks) for key in METRICS}
    mid = {
        key: statistics.mean(statistics.median(r["blocks"][key]) for r in ranks) for key in METRICS
    }
    poll = statistics.mean(r["poll_us"] for r in ranks)
    return JobRecord(round_, position, variant, True, wall, best, mid, poll, ranks)


def round_order(variants: list[str], round_: int) -> list[str]:
    """Rotate the order each round (off on, on off, ...) so no variant always runs first."""
    k = round_ % len(variants)
    return variants[k:] + variants[:k]


def progress_line(cfg: Config, job: JobRecord) -> str:
    head = f"round {job.round}/{cfg.rounds}  {job.variant:<5}"
    if not job.ok:
        return f"{head} failed ({job.wall_s:.1f} s): {job.error}"
    m = job.metrics
    ranks = job.ranks
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
            for position, variant in enumerate(round_order(list(cfg.variants), round_)):
                job = run_job(cfg, variant, round_ + 1, position, Path(tmp))
                jobs.append(job)
                print(progress_line(cfg, job), flush=True)
    return jobs


# -- summarising (data) and showing (views) -------------------------------------------
def median_se(values: list[float]) -> float | None:
    """Standard error of a median, robustly: 1.253 x (1.4826 x MAD) / sqrt(n)."""
    if len(values) < 3:
        return None
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return 1.253 * 1.4826 * mad / len(values) ** 0.5


def verdict(value: float | None, se: float | None, limit: float) -> str:
    """``met`` / ``NOT met`` when two standard errors settle it, else ``unresolved``."""
    if value is None:
        return "not measured"
    if se is None:
        return "too few rounds"
    if value + 2 * se <= limit:
        return "met"
    if value - 2 * se > limit:
        return "NOT met"
    return "unresolved"


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
                    diff_se=median_se(diffs),
                    ratio_se=median_se(ratios),
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
        "step": verdict(step.ratio, step.ratio_se, TARGET_STEP_RATIO) if step else None,
        "collectives_per_step": statistics.median(per_step) if per_step else None,
        "step_ratio_from_calls": predicted,
        "call_us_max": TARGET_CALL_US,
        "call_us_2_ranks": duo.diff if duo else None,
        "call_us_2_ranks_se": duo.diff_se if duo else None,
        "call_2_ranks": verdict(duo.diff, duo.diff_se, TARGET_CALL_US) if duo else None,
        "call_us_1_rank": solo.diff if solo else None,
        "call_us_1_rank_se": solo.diff_se if solo else None,
        "call_1_rank": verdict(solo.diff, solo.diff_se, TARGET_CALL_US) if solo else None,
        "call_us_1_rank_cpu": cpu.diff if cpu else None,
        "call_us_1_rank_cpu_se": cpu.diff_se if cpu else None,
        "call_1_rank_cpu": verdict(cpu.diff, cpu.diff_se, TARGET_CALL_US) if cpu else None,
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


def machine_info() -> dict[str, Any]:
    """Facts that make numbers comparable (or not) between machines."""
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cuda_available": torch.cuda.is_available(),
        "torch": torch.__version__,
        "load_average_before": list(os.getloadavg()),
    }


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
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a job's rank: its Config as JSON
    ns = p.parse_args(argv)
    if ns.worker:
        fields = json.loads(ns.worker)
        return ns, Config(**{**fields, "variants": tuple(fields["variants"])})
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
    if ns.worker:
        worker_main(cfg, ns.out)
        return 0
    machine = machine_info()
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
