"""The per-rank program of ``manygpu bench train`` (started by ``manygpu launch``).

Rank 0 writes its job's :class:`~manygpu.bench.train.RunStats` as JSON to
``--out``; the command that launched the jobs assembles the scaling table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from manygpu import Parallel
from manygpu.bench import models
from manygpu.bench.train import TrainBenchConfig, measure


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="manygpu.bench.train_worker")
    p.add_argument("--model", default="resnet")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--strategy", default="")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per worker (0: keep)")
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def config_from(ns: argparse.Namespace) -> TrainBenchConfig:
    return TrainBenchConfig(
        model=ns.model,
        batch=ns.batch,
        steps=ns.steps,
        warmup=ns.warmup,
        block=ns.block,
        precision=ns.precision,
        strategy=ns.strategy or None,
        peak_tflops=ns.peak_tflops or None,
    )


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    cfg = config_from(ns)
    with Parallel(strategy=cfg.strategy, precision=cfg.precision, timeout_s=600) as par:
        if ns.threads and par.device.type == "cpu":
            # The same threads per worker at every worker count: per-worker scaling.
            torch.set_num_threads(ns.threads)
        torch.manual_seed(0)  # the same initial model on every rank
        workload = models.build(cfg.model)
        stats = measure(par, workload, cfg)
        if par.is_main:
            out = Path(ns.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(stats.as_dict(), indent=2))
        par.print(
            f"  {stats.workers} worker(s): {stats.samples_per_s:,.1f} samples/s "
            f"(step {stats.step_s * 1e3:.1f} ms = compute {stats.compute_s * 1e3:.1f} "
            f"+ exposed comm {stats.comm_s * 1e3:.1f} + data {stats.data_s * 1e3:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
