"""Step time and memory per rank for each strategy on the same model (the trade-offs).

Model: an MLP of 8 x Linear(1024, 1024) (8.4M parameters) with Adam, batch 32 per
rank, fp32. Multi-process strategies run on 2 ranks (gloo) under
``manygpu launch``; single-process ones alone. Rounds are interleaved.
"state MB" is what a rank holds of parameters + gradients + Adam state (local
shards counted); "peak RSS MB" is the process's maximum resident set; on a GPU
"peak GPU MB" is ``torch.cuda.max_memory_allocated``. ``pipeline`` is 2 stages
x 4 micro-batches (1F1B); ``tensor`` splits the 4 Linear-ReLU-Linear pairs
column- then row-wise over 2 ranks (both ranks read the same batch, so their
samples/s counts one batch per step, not two).

    python bench/strategies.py [--rounds 3] [--steps 30] [--only single,model]

Prints a table and writes bench/results/strategies.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MULTI = ("ddp", "zero1", "zero2", "fsdp", "pipeline", "tensor")
DATA_COPIES = {"pipeline": 1, "tensor": 1}  # ranks reading the same batch: one batch per step
SINGLE = ("single", "model")


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(strategy: str, steps: int, out: str) -> None:
    import torch
    from torch import nn

    from manygpu import Parallel
    from manygpu.strategies import Pipeline

    loss_fn = nn.functional.mse_loss
    pipeline = Pipeline(loss_fn=loss_fn)
    par = Parallel(strategy=pipeline if strategy == pipeline.name else strategy, timeout_s=300)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    model = par.prepare(nn.Sequential(*layers))
    opt = par.prepare(torch.optim.Adam(model.parameters(), lr=1e-4))
    x, y = torch.randn(32, 1024, device=par.device), torch.randn(32, 1024, device=par.device)
    cuda = par.device.type == "cuda"
    times = []
    for i in range(steps + 5):
        start = time.perf_counter()
        loss = model(x, target=y) if strategy == "pipeline" else loss_fn(model(x), y)
        par.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - start)
    inner = getattr(opt, "optimizer", opt)
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer: its shard's one
    state = sum(_local_bytes(p) * 2 for p in model.parameters())  # params + grads
    state += sum(
        _local_bytes(v)
        for s in inner.state.values()
        for v in s.values()
        if hasattr(v, "numel") and v.dim() > 0
    )
    step_ms = torch.tensor([statistics.median(times) * 1e3])
    step_ms = par.reduce(step_ms, "max")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = {
        "strategy": strategy,
        "ranks": par.world_size,
        "step_ms": float(step_ms),
        "state_mb": state / 2**20,
        "peak_rss_mb": rss,
        "device": str(par.device),
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
    }
    rows = par.gather(torch.tensor([row["state_mb"], rss]))
    if par.is_main:
        row["state_mb_per_rank"] = rows.reshape(-1, 2)[:, 0].tolist()
        Path(out).write_text(json.dumps(row))
    par.close()


def run_one(strategy: str, steps: int) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    args = [__file__, "--worker", strategy, "--steps", str(steps), "--out", out]
    if strategy in MULTI:
        cmd = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", "2", *args]
    else:
        cmd = [sys.executable, *args]
        env["OMP_NUM_THREADS"] = "1"  # the same CPU share as one rank of a 2-rank job
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    row = json.loads(Path(out).read_text())
    os.unlink(out)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--worker", default="")
    p.add_argument("--out", default="")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "strategies.json"))
    p.add_argument("--only", default="", help="comma list of strategies to run")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    from rich.console import Console
    from rich.table import Table

    from manygpu.bench.report import machine_info, write_json

    order = [*SINGLE, *MULTI]
    if args.only:
        order = [s for s in order if s in args.only.split(",")]
    rows = []
    for rnd in range(args.rounds):
        for strategy in order[rnd % len(order) :] + order[: rnd % len(order)]:
            row = run_one(strategy, args.steps) | {"round": rnd}
            rows.append(row)
            print(
                f"round {rnd} {strategy:<7} {row['step_ms']:8.1f} ms  "
                f"state {row['state_mb']:6.1f} MB  rss {row['peak_rss_mb']:7.0f} MB",
                flush=True,
            )
    table = Table(title="8 x Linear(1024,1024) + Adam, batch 32 per rank (median over rounds)")
    for col in (
        "strategy",
        "ranks",
        "step ms",
        "samples/s",
        "state MB / rank",
        "peak RSS MB",
        "peak GPU MB",
    ):
        table.add_column(col, justify="right")
    summary = {}
    for strategy in order:
        mine = [r for r in rows if r["strategy"] == strategy]
        med = {
            k: statistics.median(r[k] for r in mine) for k in ("step_ms", "state_mb", "peak_rss_mb")
        }
        summary[strategy] = med | {"ranks": mine[0]["ranks"]}
        batches = DATA_COPIES.get(strategy, mine[0]["ranks"])
        summary[strategy]["samples_per_s"] = batches * 32 / med["step_ms"] * 1e3
        gpu = mine[0].get("peak_gpu_mb")
        summary[strategy]["peak_gpu_mb"] = gpu
        table.add_row(
            strategy,
            str(mine[0]["ranks"]),
            f"{med['step_ms']:.1f}",
            f"{summary[strategy]['samples_per_s']:,.0f}",
            f"{med['state_mb']:.1f}",
            f"{med['peak_rss_mb']:.0f}",
            "-" if gpu is None else f"{gpu:.0f}",
        )
    Console(soft_wrap=True, width=120).print(table)
    write_json(
        Path(args.json),
        {
            "command": " ".join(sys.argv),
            "machine": machine_info(),
            "summary": summary,
            "rows": rows,
        },
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
