"""What a launch costs before any training: CPU seconds of ``manygpu launch`` and its workers.

Each run is ``manygpu launch --nproc-per-node N`` of a script that imports torch,
forms the process group with ``Parallel()`` and returns: what every job pays to
start and to end, whatever it trains. The CPU of the launcher and every worker
(user + system, ``RUSAGE_CHILDREN``) is taken around each run, with and without
``MANYGPU_GC_FREEZE`` (torch's objects frozen out of Python's collector as it
loads, ``manygpu.runtime.heap``). The variants alternate within each round and the
order rotates from round to round (this machine is shared and noisy); the ratio is
the median of the per-round ratios.

Run::

    .venv/bin/python bench/launch_overhead.py              # 6 rounds, 2 workers: ~1 min
    .venv/bin/python bench/launch_overhead.py --rounds 2   # smoke run

Results: a table on stdout and JSON (default ``bench/results/launch_overhead.json``)
with the command line, the machine, the date and every run's numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
SCRIPT = """
from manygpu import Parallel
import torch

with Parallel() as par:
    torch.ones(4).sum()
"""
VARIANTS = {"frozen": "1", "collected": "0"}
"""Label -> MANYGPU_GC_FREEZE."""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(script: Path, nproc: int, freeze: str) -> dict[str, float]:
    """One launch; its CPU (launcher and workers) and wall seconds."""
    env = os.environ | {"MANYGPU_GC_FREEZE": freeze, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", str(nproc), str(script)]
    cpu0, wall0 = children_cpu(), time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    return {"cpu_s": children_cpu() - cpu0, "wall_s": time.perf_counter() - wall0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "launch_overhead.json"))
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "starts_and_ends.py"
        script.write_text(SCRIPT)
        one_run(script, args.nproc, "1")  # warm the page cache and bytecode: not counted
        names = list(VARIANTS)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                runs[name].append(one_run(script, args.nproc, VARIANTS[name]))
    pairs = zip(runs["frozen"], runs["collected"], strict=True)
    ratios = [frozen["cpu_s"] / collected["cpu_s"] for frozen, collected in pairs]
    table = Table(title=f"manygpu launch --nproc-per-node {args.nproc}: start to end")
    for col in ("variant", "CPU s (median)", "wall s (median)", "CPU vs collected"):
        table.add_column(col)
    for name in names:
        cpu = statistics.median(x["cpu_s"] for x in runs[name])
        wall = statistics.median(x["wall_s"] for x in runs[name])
        ratio = statistics.median(ratios) if name == "frozen" else 1.0
        table.add_row(name, f"{cpu:.2f}", f"{wall:.2f}", f"{ratio:.2f}x")
    Console().print(table)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "date": dt.date.today().isoformat(),
        "nproc": args.nproc,
        "runs": runs,
        "cpu_ratio_frozen_vs_collected": statistics.median(ratios),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
