"""manygpu.horovod's DistributedOptimizer against Parallel(strategy="ddp"): samples/s and ratio.

The same model (one of manygpu's benchmark workloads), the same batch per
rank, the same optimizer (SGD with momentum, with whatever ``fused`` /
``foreach`` setting Parallel gave its own), trained two ways inside one job:

- ``horovod``: ``hvd.DistributedOptimizer`` (gradients all-reduced in buckets
  while backward runs, waited for in ``step()``), as a Horovod script does;
- ``ddp``: ``Parallel(strategy="ddp", precision="fp32", channels_last=False)``,
  torch's DistributedDataParallel under manygpu.

With ``--first-bucket-mb X`` a third variant, ``horovod-first``, is the
same DistributedOptimizer given a first bucket of X MiB through ``groups=``
(torch's DDP default when ``bucket_cap_mb`` is not passed is 1 MiB; manygpu's
default has none): the question it answers is whether an early small
all-reduce pays for its extra latency on this network.

All live in every rank of one launch (``hvd.init()`` creates the process
group, ``Parallel`` joins it), so they share the machine, the network and
the launch. Timed blocks of ``--steps`` steps alternate between them, the
order rotating every round (H D, D H, ...), each block between two barriers;
a ratio is the median over rounds of a variant's samples/s over ddp's in the
same round, which cancels drift that affects a whole round.

Run::

    .venv/bin/python bench/horovod_vs_ddp.py --nproc 2                 # this machine
    .venv/bin/python bench/horovod_vs_ddp.py --launch-args "-np 4 -H h1:1,h2:1,h3:1,h4:1"

``--launch-args`` replaces ``--nproc-per-node N`` in the ``manygpu launch``
command (for hosts). Results: a table on stdout and JSON (default
``bench/results/horovod_vs_ddp.json``) with the command, the machine, the
configuration and every block's numbers.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ("horovod", "ddp")
FIRST = "horovod-first"
"""The optional variant: DistributedOptimizer with a small first bucket."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """What to measure."""

    model: str
    """A manygpu.bench.models workload: demo-cnn, resnet or gpt."""
    size: str
    """Its size: small (CPU) or full (GPU)."""
    batch: int
    """Samples per rank per step."""
    steps: int
    """Steps per timed block."""
    warmup: int
    """Untimed steps of each variant first."""
    rounds: int
    """Rounds; each times one block of each variant."""
    first_bucket_mb: float | None = None
    """Also time ``horovod-first``: a first bucket of this many MiB (``None``: not run)."""


# -- worker (runs on every rank under manygpu launch) ---------------------------------
def _optimizer(params: Any, like: Any) -> Any:
    import torch

    extra = {k: like.param_groups[0][k] for k in ("fused", "foreach") if k in like.param_groups[0]}
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, **extra)


def first_bucket_groups(model: Any, first_mb: float, cap_mb: float = 25.0) -> list[list[Any]]:
    """Parameters in the reverse of their order, cut as torch's DDP cuts its default
    buckets: the first closes once it holds ``first_mb`` MiB, the others at ``cap_mb``."""
    groups: list[list[Any]] = [[]]
    filled = 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        groups[-1].append(p)
        filled += p.numel() * p.element_size()
        if filled >= (first_mb if len(groups) == 1 else cap_mb) * (1 << 20):
            groups.append([])
            filled = 0
    return [g for g in groups if g]


def _block(step: Any, steps: int, barrier: Any, sync: Any) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    barrier()
    return time.perf_counter() - start


def variants(cfg: Config) -> tuple[str, ...]:
    """The variants this configuration times, ddp second (the baseline of every ratio)."""
    return VARIANTS + ((FIRST,) if cfg.first_bucket_mb is not None else ())


def _horovod_step(hvd: Any, work: Any, model: Any, like: Any, batch: Any, groups: Any) -> Any:
    """One training step through ``hvd.DistributedOptimizer`` (``groups``: its buckets)."""
    opt = hvd.DistributedOptimizer(
        _optimizer(model.parameters(), like), named_parameters=model.named_parameters(),
        groups=groups,
    )  # fmt: skip
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = batch

    def step() -> None:
        opt.zero_grad()
        work.loss(model(x), y).backward()
        opt.step()

    return step


def worker(cfg: Config, out: Path) -> None:
    """Build every variant from one model, warm them up, time interleaved blocks."""
    import torch

    import manygpu.horovod as hvd
    from manygpu import Parallel
    from manygpu.bench.models import build

    hvd.init()
    par = Parallel(strategy="ddp", precision="fp32", channels_last=False)
    torch.manual_seed(0)
    work = build(cfg.model, cfg.size)
    model_d = copy.deepcopy(work.model).to(par.device)
    model_d, opt_d = par.prepare(
        model_d, torch.optim.SGD(model_d.parameters(), lr=0.01, momentum=0.9)
    )
    x, y = work.make_batch(cfg.batch, torch.Generator().manual_seed(hvd.rank()))
    batch = (x.to(par.device), y.to(par.device))

    def step_d() -> None:
        opt_d.zero_grad()
        par.backward(work.loss(model_d(batch[0]), batch[1]))
        opt_d.step()

    def sync() -> None:
        if par.device.type == "cuda":
            torch.cuda.synchronize()

    steps = {"ddp": step_d}
    steps["horovod"] = _horovod_step(
        hvd, work, copy.deepcopy(work.model).to(par.device), opt_d, batch, None
    )
    if cfg.first_bucket_mb is not None:
        model_f = copy.deepcopy(work.model).to(par.device)
        groups = first_bucket_groups(model_f, cfg.first_bucket_mb)
        steps[FIRST] = _horovod_step(hvd, work, model_f, opt_d, batch, groups)
    names = variants(cfg)
    for name in names:
        _block(steps[name], cfg.warmup, hvd.barrier, sync)
    blocks = []
    for round_ in range(cfg.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        if len(names) == 2:
            order = names if round_ % 2 == 0 else names[::-1]
        for position, name in enumerate(order):
            seconds = _block(steps[name], cfg.steps, hvd.barrier, sync)
            rate = cfg.steps * cfg.batch * hvd.size() / seconds
            blocks.append({"round": round_ + 1, "position": position, "variant": name,
                           "seconds": seconds, "samples_per_s": rate})  # fmt: skip
    if hvd.rank() == 0:
        params = sum(p.numel() for p in model_d.parameters())
        info = {"world": hvd.size(), "device": str(par.device), "parameters": params,
                "workload": work.name, "blocks": blocks}  # fmt: skip
        out.write_text(json.dumps(info))
    par.close()
    hvd.shutdown()


# -- driver ---------------------------------------------------------------------------
def summarize(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Median samples/s per variant and each variant's median per-round ratio to ddp.

    ``ratios`` / ``ratio`` are horovod's; ``ratios_to_ddp`` has every variant's.
    """
    rates: dict[str, list[float]] = {}
    by_round: dict[int, dict[str, float]] = {}
    for b in blocks:
        rates.setdefault(b["variant"], []).append(b["samples_per_s"])
        by_round.setdefault(b["round"], {})[b["variant"]] = b["samples_per_s"]
    to_ddp = {
        v: [r[v] / r["ddp"] for r in by_round.values() if v in r and "ddp" in r]
        for v in rates
        if v != "ddp"
    }
    return {
        "median": {v: statistics.median(r) for v, r in rates.items()},
        "min": {v: min(r) for v, r in rates.items()},
        "max": {v: max(r) for v, r in rates.items()},
        "ratios": to_ddp.get("horovod", []),
        "ratio": statistics.median(to_ddp["horovod"]) if to_ddp.get("horovod") else None,
        "ratios_to_ddp": to_ddp,
        "ratio_to_ddp": {v: statistics.median(r) for v, r in to_ddp.items() if r},
    }


def render(report: dict[str, Any]) -> str:
    """The summary as a plain-text table."""
    s, cfg, run = report["summary"], report["config"], report["run"]
    lines = [
        f"horovod vs ddp: {run['workload']} ({run['parameters']:,} parameters), "
        f"{run['world']} ranks on {run['device']}, batch {cfg['batch']} per rank, "
        f"{cfg['rounds']} rounds x {cfg['steps']} steps per block",
        f"{'variant':<15}{'median':>12}{'min':>12}{'max':>12}   samples/s (all ranks)",
    ]
    for v in s["median"]:
        lines.append(f"{v:<15}{s['median'][v]:>12,.1f}{s['min'][v]:>12,.1f}{s['max'][v]:>12,.1f}")
    for v, ratios in s.get("ratios_to_ddp", {"horovod": s["ratios"]}).items():
        per_round = ", ".join(f"{r:.3f}" for r in ratios)
        median = statistics.median(ratios)
        lines.append(f"ratio {v}/ddp (median of per-round ratios): {median:.3f}  [{per_round}]")
    return "\n".join(lines)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # local ranks; hosts: set it to their interface
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def drive(cfg: Config, launch_args: list[str], timeout_s: float) -> dict[str, Any]:
    """One launch of the worker on every rank; its rank 0's numbers with the summary."""
    with tempfile.TemporaryDirectory(prefix="horovod_vs_ddp-") as tmp:
        result = Path(tmp) / "result.json"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(cfg).items() if v is not None]
        cmd = [sys.executable, "-m", "manygpu", "launch", *launch_args, str(Path(__file__)),
               "--worker", f"--result={result}", *flags]  # fmt: skip
        proc = subprocess.run(cmd, env=_env(), timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
            raise SystemExit(f"the benchmark job failed (exit {proc.returncode}):\n{tail}")
        run = json.loads(result.read_text())
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "launch": shlex.join(cmd),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "config": asdict(cfg),
        "run": {k: v for k, v in run.items() if k != "blocks"},
        "blocks": run["blocks"],
        "summary": summarize(run["blocks"]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet", help="demo-cnn, resnet or gpt")
    p.add_argument("--size", default="small", choices=("small", "full"))
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument(
        "--first-bucket-mb",
        type=float,
        default=None,
        help="also time DistributedOptimizer with a first bucket of this many MiB",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    p.add_argument("--launch-args", default=None, help="replaces --nproc-per-node N")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole job")
    p.add_argument("--out", type=Path, default=HERE / "results" / "horovod_vs_ddp.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    for name in ("batch", "steps", "rounds", "nproc"):
        if getattr(ns, name) < 1:
            p.error(f"--{name} must be >= 1")
    if ns.first_bucket_mb is not None and not ns.first_bucket_mb > 0:
        p.error("--first-bucket-mb must be > 0")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    cfg = Config(model=ns.model, size=ns.size, batch=ns.batch, steps=ns.steps,
                 warmup=ns.warmup, rounds=ns.rounds,
                 first_bucket_mb=ns.first_bucket_mb)  # fmt: skip
    if ns.worker:
        worker(cfg, ns.result)
        return 0
    launch = shlex.split(ns.launch_args) if ns.launch_args else ["--nproc-per-node", str(ns.nproc)]
    report = drive(cfg, launch, ns.timeout)
    print(render(report))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"raw results: {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
