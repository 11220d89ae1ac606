"""``manygpu demo``: the main job, real training on every local device."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from manygpu.core.config import PRECISIONS
from manygpu.core.data import per_rank_batch
from manygpu.errors import UsageError
from manygpu.flags import positive_int
from manygpu.launch import LaunchRequest, launch, resolve
from manygpu.runtime import env as envmod
from manygpu.strategies import available, get_strategy


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train a CNN on the digits on every local device",
        description="Train SimpleCNN on scikit-learn's digits with every local "
        "GPU (or 2 CPU processes), then report accuracy, speed-up and efficiency.",
    )
    p.add_argument("--workers", type=positive_int, help="processes (default: GPUs, or 2 on CPU)")
    p.add_argument("--epochs", type=positive_int, default=6)
    p.add_argument("--strategy", default="ddp", help=f"one of: {', '.join(available())}")
    p.add_argument("--precision", default="fp32", help=f"one of: {', '.join(PRECISIONS)}")
    p.add_argument("--global-batch-size", type=positive_int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--json", help="also write the results to this JSON file")
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    if ns.precision not in PRECISIONS:
        raise UsageError(
            f"unknown precision {ns.precision!r}; choose one of {', '.join(PRECISIONS)}"
        )
    if ns.epochs < 1:
        raise UsageError(f"--epochs must be at least 1, got {ns.epochs}")
    strategy = get_strategy(ns.strategy)
    workers = ns.workers if strategy.multi_process else 1
    args = [
        "--epochs",
        str(ns.epochs),
        "--strategy",
        ns.strategy,
        "--precision",
        ns.precision,
        "--global-batch-size",
        str(ns.global_batch_size),
        "--lr",
        str(ns.lr),
    ]
    if ns.json:
        args += ["--json", ns.json]
    request = LaunchRequest(
        entry="manygpu.demo.train", is_module=True, args=tuple(args), nproc_per_node=workers
    )
    spec = resolve(request, envmod.current(), torch.cuda.device_count())
    per_rank_batch(ns.global_batch_size, spec.nproc_per_node, split=True)
    return launch(spec)
