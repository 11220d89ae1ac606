"""One rank of one job of ``bench/straggler_overhead.py``: train the demo, time every step.

The job is the path a user takes: ``Parallel(strategy="ddp", stragglers=...)``,
``par.prepare`` of ``manygpu demo``'s SimpleCNN, an AdamW optimizer and a
``DataLoader`` of the digits (the demo's global batch of 64 split over the
ranks: 32 per rank on 2), ``par.backward``, ``opt.step``. Only ``stragglers``
differs between the driver's variants, so only the straggler reports (the
step clock on the training thread, DDP's runtime-stats sampling at the clock's
rate, the board's daemon thread) differ between their step times.

The clock is read right after every ``opt.step()``/``zero_grad()``: a step is
one such stamp to the next, so the loader's fetch, forward, backward (with the
gradient all-reduce), the optimizer and the clock's own tick are all inside it.
After a warm-up, ``steps`` such steps are kept; the rank writes their median,
mean and tail, what the board collected (rank 0: the windows it judged), and
the cost of one read of DDP's reducer timers (the probe the clock calls every
``every // 10`` steps), timed after training so it does not disturb the steps.

:func:`clock_cost` is the driver's other measurement, run in its own process
while no job runs: the clock's cost on the training thread alone.

Started by the driver with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
set (no launcher)::

    python bench/straggler_overhead_worker.py --config '{...}' --out /tmp/job
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from manygpu import Parallel
from manygpu.demo.config import DemoConfig
from manygpu.demo.data import digits
from manygpu.demo.model import SimpleCNN
from manygpu.strategies.ddp.strategy import _ReducerTimes

DEMO = DemoConfig()
"""The demo's defaults: image size, global batch and learning rate come from here."""


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """One job's training; identical across variants except ``stragglers``."""

    stragglers: bool | int
    """``Parallel(stragglers=...)``: ``False`` off, ``True`` every 50 steps, N every N."""
    warmup: int
    """Untimed steps first (allocator, autograd, gloo, the first window's set-up)."""
    steps: int
    """Timed steps, each one optimizer step to the next."""
    probe_calls: int
    """Reads of DDP's reducer timers timed after training (the clock's probe)."""
    seed: int = 0
    """``Parallel(seed=...)``: same weights, data order and dropout in every variant."""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _probe_us(model: torch.nn.Module, calls: int) -> float | None:
    """Microseconds per call of the step clock's DDP probe (median of blocks of 10)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or calls < 10:
        return None
    probe = _ReducerTimes(model)
    blocks = []
    for _ in range(calls // 10):
        start = time.perf_counter()
        for _ in range(10):
            probe()
        blocks.append((time.perf_counter() - start) / 10)
    return statistics.median(blocks) * 1e6


def train(cfg: WorkerConfig) -> dict[str, Any]:
    """Train warm-up + timed steps; this rank's numbers."""
    par = Parallel(
        strategy="ddp",
        device="cpu",
        precision=DEMO.precision,
        split_batches=True,  # as manygpu demo: the loader's batch is the global one
        seed=cfg.seed,
        stragglers=cfg.stragglers,
    )
    with par:
        train_set, _ = digits(DEMO.image_size)
        model = SimpleCNN(DEMO.image_size)
        opt = torch.optim.AdamW(model.parameters(), lr=DEMO.lr)
        loader = DataLoader(
            train_set, batch_size=DEMO.global_batch_size, shuffle=True, drop_last=True
        )
        model, opt, loader = par.prepare(model, opt, loader)
        stamps: list[float] = []
        wanted = cfg.warmup + cfg.steps + 1
        loss = torch.zeros(())
        batch = 0
        while len(stamps) < wanted:  # epochs of 22 steps: a new epoch is part of the path
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                par.backward(loss)
                opt.step()
                opt.zero_grad()
                stamps.append(time.perf_counter())
                batch = int(y.numel())
                if len(stamps) >= wanted:
                    break
        probe_us = _probe_us(model, cfg.probe_calls)
        final_loss = float(par.reduce(loss.detach(), "mean"))
        clock = par._reports.clock if par._reports is not None else None
        probe_every = clock.probe_every if clock is not None else None
    # After close: the main rank's board has collected the last windows it could.
    rows = par.step_times
    timed = stamps[cfg.warmup :]
    steps = [(b - a) * 1e3 for a, b in itertools.pairwise(timed)]
    return {
        "rank": par.rank,
        "world_size": par.world_size,
        "per_rank_batch": batch,
        "threads": torch.get_num_threads(),
        "steps": len(steps),
        "median_ms": statistics.median(steps),
        "mean_ms": statistics.fmean(steps),
        "p90_ms": _percentile(steps, 0.9),
        "max_ms": max(steps),
        "reports_on": par._reports is not None,
        "probe_every": probe_every,
        "windows_judged": (rows[0]["window"] + 1) if rows else 0,
        "last_window": rows,
        "probe_us": probe_us,
        "final_loss": final_loss,
    }


def clock_cost(calls: int, every: int, blocks: int = 10) -> dict[str, float]:
    """The training thread's share, in this process: ns per step of the clock's two calls.

    ``waited_for_input`` + ``step`` of a :class:`~manygpu.observe.step_clock.StepClock`
    with a no-op sink and a probe that returns ``None`` (the probe's real cost is
    :func:`_probe_us`'s), less an empty loop's time per iteration; median of
    ``blocks`` blocks, the clock's and the empty loop's alternating so drift hits both.
    """
    from manygpu.observe.step_clock import StepClock

    clock = StepClock(every, 0, "bench", 0, lambda split: None)
    clock.attach(lambda: None)
    wait, step = clock.waited_for_input, clock.step
    per = max(1, calls // blocks)
    full, empty = [], []
    for _ in range(blocks):
        start = time.perf_counter_ns()
        for _ in range(per):
            wait(1e-4)
            step()
        full.append((time.perf_counter_ns() - start) / per)
        start = time.perf_counter_ns()
        for _ in range(per):
            pass
        empty.append((time.perf_counter_ns() - start) / per)
    raw, loop = statistics.median(full), statistics.median(empty)
    return {
        "every": every,
        "probe_every": clock.probe_every,
        "calls": per * blocks,
        "raw_ns": raw,
        "loop_ns": loop,
        "ns_per_step": raw - loop,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="WorkerConfig as JSON")
    p.add_argument("--out", type=Path, required=True, help="folder; writes rank<N>.json")
    ns = p.parse_args(argv)
    cfg = WorkerConfig(**json.loads(ns.config))
    result = train(cfg)
    (ns.out / f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
