"""What FSDP2's CPU-mesh settings cost a training step: manygpu's against FSDP2's defaults.

On a CPU mesh manygpu turns FSDP2's backward prefetch off, reduce-scatters
gradients in place and trims the heap after each block
(``src/manygpu/strategies/fsdp/host.py``), which holds a rank's host memory to
its share (``bench/prepare_memory.py``). This measures their price: the same
job launched by ``manygpu launch`` with them (``manygpu``) and with FSDP2's
defaults put back after ``prepare`` (``fsdp2-defaults``), launches interleaved
(ABAB..., the order swapped every round), each timing ``--steps`` AdamW steps
of a GPT after 3 warm-up steps (``prepare_memory_worker.py``'s ``loop`` mode).

Run::

    .venv/bin/python bench/fsdp_cpu_step.py --nproc 2 --rounds 4

Prints per-launch seconds per step (wall and CPU, rank 0) and the ratio of the
medians; JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "prepare_memory_worker.py"
VARIANTS = {"manygpu": False, "fsdp2-defaults": True}
"""Variant name -> whether FSDP2's defaults are put back after prepare."""


def launch(args: argparse.Namespace, defaults: bool) -> dict[str, float]:
    """One job: rank 0's wall and CPU seconds per step."""
    with tempfile.TemporaryDirectory(prefix="fsdp-cpu-step-") as out:
        cfg = {
            "mode": "loop", "strategy": args.strategy, "size_gb": args.size, "dim": args.dim,
            "batch": args.batch, "steps": args.steps, "out_dir": out, "fsdp_defaults": defaults,
        }  # fmt: skip
        cmd = [
            sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", str(args.nproc),
            str(WORKER), "--config", json.dumps(cfg),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            sys.exit(done.stdout[-2000:] + done.stderr[-2000:])
        (loop,) = json.loads((Path(out) / "rank0.json").read_text())["phases"]
        return {"seconds": loop["seconds"], "cpu_seconds": loop["cpu_seconds"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategy", default="fsdp", choices=["fsdp", "hsdp"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--size", type=float, default=0.1, help="model's fp32 GB (default 0.1)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="sequences of 64 tokens per rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "fsdp_cpu_step.json")
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for rnd in range(args.rounds):
        order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            runs[name].append(launch(args, VARIANTS[name]))
            print(f"round {rnd + 1} {name:15s} {runs[name][-1]}", flush=True)
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "cpu_seconds")}
        for name, rs in runs.items()
    }
    ratio = {k: med["manygpu"][k] / med["fsdp2-defaults"][k] for k in ("seconds", "cpu_seconds")}
    print(f"medians {med}\nmanygpu / fsdp2-defaults: {ratio}")
    record: dict[str, Any] = {
        "command": sys.argv,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs, "medians": med, "ratio": ratio,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
