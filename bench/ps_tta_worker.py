"""One time-to-accuracy run of the demo task (digits, SimpleCNN) under ddp or parameter servers.

Launched once per configuration, e.g.::

    manygpu launch --nproc-per-node 4 bench/ps_tta_worker.py OUT.json --strategy ddp
    manygpu launch --ps 1 --nproc-per-node 4 bench/ps_tta_worker.py OUT.json \\
        --strategy ps --mode async --slow-rank 2 --slow-ms 200

Each worker trains ``--epochs`` passes over its share with ``--batch`` samples
per step (Adam); ``--slow-rank`` (a worker index) sleeps ``--slow-ms`` after
every backward: a straggler. The first worker evaluates the held-out digits
every ``--eval-every`` of its steps, alone (no collective, so it never
synchronises an asynchronous job), and records when the accuracy first
reached ``--target``, counted from the start of the loop. Samples trained by
then come from the servers' update count (async: one worker batch per update;
sync: one per worker) or, for ddp, from the steps. The first worker writes
OUT.json: the curve, the time to accuracy, samples/s, and its median compute
time per step (forward + backward), which the planner's straggler model
(:mod:`manygpu.plan.uneven_hosts`) takes as input.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from manygpu import PS, Parallel
from manygpu.demo.data import digits
from manygpu.demo.model import SimpleCNN


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--mode", default="sync", choices=("sync", "async"))
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    return p.parse_args()


def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        right = (model(images).argmax(1) == labels).float().mean().item()
    model.train()
    return right


def trained_samples(par: Parallel, steps: int, batch: int, mode: str) -> int:
    """Samples every worker together has trained on, as far as this worker knows."""
    stats = getattr(par.strategy, "stats", None)
    if stats is None or not stats.updates:
        return steps * batch * par.world_size
    per_update = batch if mode == "async" else batch * par.world_size
    return stats.updates[0] * per_update


def main() -> None:
    args = parse()
    ps = PS(mode=args.mode, max_staleness=args.max_staleness)
    with Parallel(strategy=ps if args.strategy == ps.name else args.strategy) as par:
        train, test = digits(16)
        images, labels = test.tensors
        model = SimpleCNN(16)
        loader = DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True)
        model, opt, loader = par.prepare(model, torch.optim.Adam(model.parameters(), lr=args.lr),
                                         loader)  # fmt: skip
        curve, compute, tta, steps = [], [], None, 0
        start = time.perf_counter()
        for _ in range(args.epochs):
            for x, y in par.progress(loader, "training"):
                began = time.perf_counter()
                par.backward(F.cross_entropy(model(x), y))
                compute.append(time.perf_counter() - began)
                if par.rank == args.slow_rank:
                    time.sleep(args.slow_ms / 1e3)
                opt.step()
                opt.zero_grad()
                steps += 1
                if par.is_main and steps % args.eval_every == 0:
                    acc = accuracy(model, images.to(par.device), labels.to(par.device))
                    now = time.perf_counter() - start
                    curve.append((now, trained_samples(par, steps, args.batch, args.mode), acc))
                    if tta is None and acc >= args.target:
                        tta = (now, curve[-1][1])
        seconds = time.perf_counter() - start
        if par.is_main:
            samples = trained_samples(par, steps, args.batch, args.mode)
            result = {
                "strategy": par.strategy_name, "mode": args.mode if args.strategy == "ps" else None,
                "workers": par.world_size, "batch": args.batch, "slow_rank": args.slow_rank,
                "slow_ms": args.slow_ms, "target": args.target, "seconds": seconds,
                "samples_per_s": samples / seconds, "tta_s": tta[0] if tta else None,
                "tta_samples": tta[1] if tta else None, "curve": curve,
                "step_compute_s": statistics.median(compute),
                "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            }  # fmt: skip
            args.out.write_text(json.dumps(result, indent=1))
            reached = f"{tta[0]:.1f} s" if tta else "not reached"
            par.print(f"{par.strategy_name} {args.mode}: {args.target:.0%} held-out accuracy "
                      f"{reached}; {result['samples_per_s']:,.0f} samples/s")  # fmt: skip


if __name__ == "__main__":
    main()
