"""What the overhead benchmarks share: interleaved rounds, median ± SE, machine facts.

``bench/hang_records_overhead.py`` and ``bench/straggler_overhead.py`` both time
2-rank gloo jobs on 127.0.0.1, one variant per job, in rounds whose order
rotates (:func:`round_order`), and judge a variant by the median over rounds
of its ratio to the baseline, with a robust standard error (:func:`median_se`)
and a verdict that only two standard errors can settle (:func:`verdict`).
:func:`run_ranks` runs a job's rank processes (:func:`loopback_env`, on a
:func:`free_port`). The drivers import this module
as a sibling (``python bench/<driver>.py`` puts ``bench/`` on ``sys.path``).
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a job's ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_env(base: Mapping[str, str], rank: int, port: int) -> dict[str, str]:
    """``base`` plus one rank of a 2-rank job started by hand on loopback: 1 thread, CPU only."""
    env = dict(base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
    )  # fmt: skip
    return env


@dataclass
class RanksRun:
    """What :func:`run_ranks` saw of a job's rank processes."""

    outputs: list[str]
    """Each rank's stdout and stderr, merged."""
    codes: list[int | None]
    """Each rank's exit status (negative: killed by that signal)."""
    timed_out: bool
    wall_s: float
    """Whole job, start-up included."""


def run_ranks(cmd: list[str], envs: list[dict[str, str]], timeout_s: float) -> RanksRun:
    """Run ``cmd`` once per environment (a rank each), wait; past ``timeout_s`` kill them all."""
    start = time.perf_counter()
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for env in envs
    ]
    outputs, codes, timed_out = [], [], False
    try:
        for proc in procs:
            left = max(1.0, start + timeout_s - time.perf_counter())
            try:
                outputs.append(proc.communicate(timeout=left)[0])
            except subprocess.TimeoutExpired:
                timed_out = True
                for p in procs:
                    p.kill()  # our own children, by handle
                outputs.append(proc.communicate()[0])
            codes.append(proc.returncode)
    finally:
        for p in procs:  # interrupted (Ctrl-C): leave no rank behind
            if p.poll() is None:
                p.kill()
                p.wait()
    return RanksRun(outputs, codes, timed_out, time.perf_counter() - start)


def round_order(variants: list[str], round_: int) -> list[str]:
    """Rotate the order each round (off on, on off, ...) so no variant always runs first."""
    k = round_ % len(variants)
    return variants[k:] + variants[:k]


def median_se(values: list[float]) -> float | None:
    """Standard error of a median, robustly: 1.253 x (1.4826 x MAD) / sqrt(n)."""
    if len(values) < 3:
        return None
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return 1.253 * 1.4826 * mad / len(values) ** 0.5


def verdict(
    value: float | None,
    se: float | None,
    limit: float,
    *,
    not_met: str = "NOT met",
    unresolved: str = "unresolved",
) -> str:
    """``met`` / ``not_met`` when two standard errors settle it, else ``unresolved``."""
    if value is None:
        return "not measured"
    if se is None:
        return "too few rounds"
    if value + 2 * se <= limit:
        return "met"
    if value - 2 * se > limit:
        return not_met
    return unresolved


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
