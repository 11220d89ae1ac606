"""Time and bytes to save / load a ~100M-parameter checkpoint: full vs sharded, sync vs async.

Runs 2 ranks (DDP, gloo) under ``manygpu launch``: a 6 x Linear(4096, 4096)
model (100.7M parameters) with Adam state (3 x 403 MB), saved and loaded with
manygpu's Checkpointer in the three ways, interleaved over rounds. "stall" is
how long ``save()`` blocks training; for async saves the write, fsync, hash and
commit go on in a background thread after a CPU snapshot.

    python bench/checkpoint_io.py [--rounds 3] [--dir /tmp/mg-ckpt-bench]

Prints a table and writes bench/results/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("full", "full-async", "dcp")


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from manygpu import Parallel
    from manygpu.checkpoint import Checkpointer, TrainState

    par = Parallel(strategy="ddp", timeout_s=600)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = par.prepare(model, opt)
    par.backward(model(torch.randn(2, 4096)).sum())
    opt.step()  # creates Adam's exp_avg / exp_avg_sq
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for rnd in range(args.rounds):
        for variant in VARIANTS[rnd % 3:] + VARIANTS[: rnd % 3]:  # rotate the order
            directory = Path(args.dir) / f"{variant}-{rnd}"
            ckpt = Checkpointer(par, directory, model=model, optimizer=opt, keep=1,
                                format="dcp" if variant == "dcp" else "full",
                                async_save=variant == "full-async", handle_signals=False)
            par.barrier()
            start = time.perf_counter()
            ckpt.save(TrainState(step=1))
            stall = time.perf_counter() - start
            ckpt.wait()
            par.barrier()
            saved = time.perf_counter() - start
            size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
            par.barrier()
            start = time.perf_counter()
            ckpt.resume()
            loaded = time.perf_counter() - start
            rows.append({"variant": variant, "round": rnd, "stall_s": stall, "save_s": saved,
                         "load_s": loaded, "bytes": size})
            par.barrier()
            if par.is_main:
                shutil.rmtree(directory, ignore_errors=True)
                par.print(f"round {rnd} {variant:<10} stall {stall:6.2f}s  save {saved:6.2f}s  "
                          f"load {loaded:6.2f}s  {size / 1e6:,.0f} MB")
    if par.is_main:
        Path(args.out).write_text(json.dumps({"parameters": params, "rows": rows}))
    par.close()


def summarize(data: dict, command: str) -> dict:
    from rich.console import Console
    from rich.table import Table

    from manygpu.bench.report import machine_info

    table = Table(title=f"checkpoint of {data['parameters'] / 1e6:.1f}M parameters + Adam, "
                        "2 ranks (median over rounds)")
    for col in ("variant", "stall (s)", "save (s)", "load (s)", "MB", "write GB/s"):
        table.add_column(col, justify="right")
    summary = {}
    for variant in VARIANTS:
        rows = [r for r in data["rows"] if r["variant"] == variant]
        med = {k: statistics.median(r[k] for r in rows) for k in ("stall_s", "save_s", "load_s",
                                                                  "bytes")}
        summary[variant] = med
        table.add_row(variant, f"{med['stall_s']:.2f}", f"{med['save_s']:.2f}",
                      f"{med['load_s']:.2f}", f"{med['bytes'] / 1e6:,.0f}",
                      f"{med['bytes'] / med['save_s'] / 1e9:.2f}")
    Console(soft_wrap=True, width=140).print(table)
    return {"command": command, "machine": machine_info(), "summary": summary, **data}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/tmp/mg-ckpt-bench")
    p.add_argument("--out", default="")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "checkpoint_io.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    raw = Path(args.dir) / "raw.json"
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", "2", __file__,
           "--worker", "--rounds", str(args.rounds), "--dir", args.dir, "--out", str(raw)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run(cmd, check=True, env=env)
    result = summarize(json.loads(raw.read_text()), " ".join(sys.argv))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
