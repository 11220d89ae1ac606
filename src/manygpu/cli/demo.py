"""``manygpu demo``: the main job, real training on every local device."""

from __future__ import annotations

import argparse
from typing import Any

from manygpu.cli.launch import launch_spec, resolve_request
from manygpu.cli.tracking_flags import add_tracking_options, chosen
from manygpu.flags import positive_int
from manygpu.launch.spec import LaunchRequest


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train a CNN on the digits on every local device",
        description="Train SimpleCNN on scikit-learn's digits with every local "
        "GPU (or 2 CPU processes), then report accuracy and throughput, and with "
        "several workers the speed-up over one worker and the scaling efficiency.",
    )
    p.add_argument("--workers", type=positive_int, help="processes (default: GPUs, or 2 on CPU)")
    p.add_argument("--epochs", type=positive_int, default=6)
    p.help_later(p.add_argument("--strategy", default="ddp"), _strategy_help)
    p.help_later(p.add_argument("--precision", default="fp32"), _precision_help)
    p.add_argument("--global-batch-size", type=positive_int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--json", help="also write the results to this JSON file")
    add_tracking_options(p)
    p.set_defaults(run=run)


def _strategy_help() -> str:
    from manygpu.strategies import available

    return f"one of: {', '.join(available())}"


def _precision_help() -> str:
    from manygpu.core.config import PRECISIONS

    return f"one of: {', '.join(PRECISIONS)}"


def announcement(epochs: int, workers: int | None) -> str:
    """What the demo is about to do: said before anything slow, so it never starts in silence.

    It is printed before PyTorch is even imported (seconds on a busy machine)
    and long before the workers' first epoch, so it uses only the options.
    """
    where = f"{workers} worker(s)" if workers else "every local GPU (or 2 CPU workers)"
    windows = max(epochs - 1, 1)
    timing = (
        f"; with several workers, {windows} epoch(s) are timed, each against one worker "
        "alone, for the speed-up"
        if workers != 1
        else ""  # one worker: nothing to compare
    )
    return (
        f"manygpu demo: training a small CNN on scikit-learn's digits for {epochs} epoch(s) "
        f"on {where}{timing}. Starting PyTorch and the workers first."
    )


def run(ns: argparse.Namespace) -> int:
    log_with, run_dir = chosen(ns)  # a missing extra fails before anything starts
    print(announcement(ns.epochs, ns.workers), flush=True)
    from manygpu.core.data import per_rank_batch
    from manygpu.demo.config import DemoConfig
    from manygpu.runtime import handoff
    from manygpu.strategies import get_strategy

    config = DemoConfig(
        epochs=ns.epochs,
        global_batch_size=ns.global_batch_size,
        lr=ns.lr,
        strategy=ns.strategy,
        precision=ns.precision,
        json_path=ns.json,
        log_with=log_with,
        run_dir=run_dir,
    )
    workers = ns.workers if get_strategy(config.strategy).multi_process else 1
    request = LaunchRequest(
        entry="manygpu.demo.train",
        is_module=True,
        nproc_per_node=workers,
        worker_env=handoff.worker_env(config),
    )
    spec = resolve_request(request)
    per_rank_batch(config.global_batch_size, spec.nproc_per_node, split=True)
    print(f"manygpu demo: launching {spec.nproc_per_node} worker process(es)", flush=True)
    return launch_spec(spec)
