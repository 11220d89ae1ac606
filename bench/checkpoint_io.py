"""Checkpoint save / resume against plain ``torch.save`` / ``torch.load`` of the same state.

Runs ranks (DDP, gloo) under ``manygpu launch``: a 6 x Linear(4096, 4096) model
(100.7M parameters, 403 MB) with Adam state (3 x 403 MB in all). Each round,
interleaved in a rotating order:

- ``torch.save``: the main rank saves ``model.state_dict()`` and
  ``optimizer.state_dict()`` with ``torch.save`` (and, timed apart, fsyncs them:
  ``torch.save + fsync``), then every rank loads them with ``torch.load`` and
  ``load_state_dict`` (the reference);
- ``full`` / ``full-async`` / ``dcp`` / ``dcp-async``: manygpu's Checkpointer
  (hashing, fsync, meta.json and the atomic rename included), then ``resume()``
  (verification of every file's checksum included). ``dcp-async`` goes through
  torch's ``dcp.async_save`` and its stager.

"stall" is how long ``save()`` blocks training (for async saves: the copy into
the reused CPU buffers). Ratios are taken per round against that round's
``torch.save`` run, then the median over rounds.

    python bench/checkpoint_io.py [--rounds 3] [--nproc 2] [--dir /tmp/mg-ckpt-bench]

Prints a table and writes bench/results/checkpoint_io.json (or --json).
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("torch.save", "full", "full-async", "dcp", "dcp-async")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain(par: Any, module: Any, opt: Any, directory: Path) -> dict[str, float]:
    """torch.save / torch.load of the same state dicts, on the main rank."""
    import torch

    row = {"stall_s": 0.0, "save_s": 0.0, "fsync_s": 0.0, "load_s": 0.0}
    par.barrier()
    files = {directory / "model.pt": module, directory / "optim.pt": opt}
    if par.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        for path, owner in files.items():
            torch.save(owner.state_dict(), path)
        row["save_s"] = row["stall_s"] = time.perf_counter() - start
        start = time.perf_counter()
        for path in files:
            _fsync(path)
        row["fsync_s"] = time.perf_counter() - start
    par.barrier()
    # Every rank loads, as every rank of a data-parallel job must (and resume() does).
    start = time.perf_counter()
    for path, owner in ((directory / "model.pt", module), (directory / "optim.pt", opt)):
        owner.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    row["load_s"] = time.perf_counter() - start
    par.barrier()
    return row


def _manygpu(par: Any, model: Any, opt: Any, directory: Path, variant: str) -> dict[str, float]:
    from manygpu.checkpoint import Checkpointer, TrainState

    # keep=2: the timed second save deletes nothing (torch.save does not either).
    ckpt = Checkpointer(
        par,
        directory,
        model=model,
        optimizer=opt,
        keep=2,
        format=variant.split("-")[0],
        async_save=variant.endswith("-async"),
        handle_signals=False,
    )
    row = {}
    for step in (1, 2):  # the second save reuses the async snapshot buffers: time that one
        par.barrier()
        start = time.perf_counter()
        ckpt.save(TrainState(step=step))
        row["stall_s"] = time.perf_counter() - start
        ckpt.wait()
        par.barrier()
        row["save_s"] = time.perf_counter() - start
    par.barrier()
    start = time.perf_counter()
    ckpt.resume()
    row["load_s"] = time.perf_counter() - start
    ckpt.close()  # lets the snapshot buffers go before the next variant
    return row


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from manygpu.core.parallel import Parallel

    par = Parallel(strategy="ddp", timeout_s=600)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = par.prepare(model, opt)
    par.backward(model(torch.randn(2, 4096)).sum())
    opt.step()  # creates Adam's exp_avg / exp_avg_sq
    module, inner = par.unwrap(model), par.job_state.parts(model, opt).optimizer
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for rnd in range(args.rounds):
        turn = rnd % len(VARIANTS)
        for variant in VARIANTS[turn:] + VARIANTS[:turn]:  # rotate the order
            directory = Path(args.dir) / f"{variant}-{rnd}"
            if variant == "torch.save":
                row = _plain(par, module, inner, directory)
            else:
                row = _manygpu(par, model, opt, directory, variant)
            last = directory / "step-00000002" if variant != "torch.save" else directory
            size = sum(
                f.stat().st_size
                for f in last.rglob("*")
                if f.is_file() and not f.name.startswith(("rng-", "meta"))
            )
            rows.append({"variant": variant, "round": rnd, "bytes": size, **row})
            par.barrier()
            if par.is_main:
                shutil.rmtree(directory, ignore_errors=True)
                par.print(
                    f"round {rnd} {variant:<10} stall {row['stall_s']:6.2f}s  "
                    f"save {row['save_s']:6.2f}s  load {row['load_s']:6.2f}s  "
                    f"{size / 1e6:,.0f} MB"
                )
    if par.is_main:
        Path(args.out).write_text(
            json.dumps({"parameters": params, "ranks": par.world_size, "rows": rows})
        )
    par.close()


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per round, each variant's times over that round's torch.save run; median over rounds."""
    ref = {r["round"]: r for r in rows if r["variant"] == "torch.save"}
    out: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        base = ref[r["round"]]
        got = out.setdefault(
            r["variant"], {"save": [], "save_vs_fsync": [], "stall": [], "load": []}
        )
        got["save"].append(r["save_s"] / base["save_s"])
        got["save_vs_fsync"].append(r["save_s"] / (base["save_s"] + base["fsync_s"]))
        got["stall"].append(r["stall_s"] / base["save_s"])
        got["load"].append(r["load_s"] / base["load_s"])
    return {v: {k: statistics.median(xs) for k, xs in d.items()} for v, d in out.items()}


def summarize(data: dict[str, Any], command: str) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from manygpu.bench.report import machine_info

    table = Table(
        title=f"checkpoint of {data['parameters'] / 1e6:.1f}M parameters + Adam, "
        f"{data['ranks']} ranks (median over rounds; x = / torch.save)"
    )
    for col in (
        "variant",
        "stall (s)",
        "save (s)",
        "load (s)",
        "MB",
        "stall x",
        "save x",
        "save x (vs +fsync)",
        "load x",
    ):
        table.add_column(col, justify="right")
    rel = ratios(data["rows"])
    summary = {}
    for variant in VARIANTS:
        rows = [r for r in data["rows"] if r["variant"] == variant]
        med = {
            k: statistics.median(r[k] for r in rows)
            for k in ("stall_s", "save_s", "load_s", "bytes")
        }
        if variant == "torch.save":
            med["fsync_s"] = statistics.median(r["fsync_s"] for r in rows)
        summary[variant] = med | {"ratio": rel[variant]}
        x = rel[variant]
        table.add_row(
            variant,
            f"{med['stall_s']:.2f}",
            f"{med['save_s']:.2f}",
            f"{med['load_s']:.2f}",
            f"{med['bytes'] / 1e6:,.0f}",
            f"{x['stall']:.2f}",
            f"{x['save']:.2f}",
            f"{x['save_vs_fsync']:.2f}",
            f"{x['load']:.2f}",
        )
    Console(soft_wrap=True, width=160).print(table)
    fsync = summary["torch.save"]["fsync_s"]
    print(
        f"torch.save + fsync: {summary['torch.save']['save_s'] + fsync:.2f} s "
        f"(fsync alone {fsync:.2f} s); manygpu's saves include their fsync"
    )
    return {"command": command, "machine": machine_info(), "summary": summary, **data}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
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
    cmd = [
        sys.executable,
        "-m",
        "manygpu",
        "launch",
        "--nproc-per-node",
        str(args.nproc),
        __file__,
        "--worker",
        "--rounds",
        str(args.rounds),
        "--dir",
        args.dir,
        "--out",
        str(raw),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run(cmd, check=True, env=env)
    result = summarize(json.loads(raw.read_text()), " ".join(sys.argv))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
