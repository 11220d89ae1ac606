"""The per-rank program of ``manygpu bench comm`` (started by ``manygpu launch``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

from manygpu import Parallel
from manygpu.bench import report
from manygpu.bench.comm import SweepConfig, memcpy_gbs, sweep
from manygpu.errors import UsageError


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864; K, M, G are powers of 1024."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    clean = text.strip().upper().removesuffix("B")
    try:
        if clean and clean[-1] in units:
            return int(float(clean[:-1]) * units[clean[-1]])
        return int(clean)
    except ValueError:
        raise UsageError(f"{text!r} is not a size; write e.g. 8, 64K, 1M or 1G") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="manygpu.bench.comm_worker")
    p.add_argument("--ops", default="all_reduce")
    p.add_argument("--algorithms", default="native,ring,ps,tree")
    p.add_argument("--min-bytes", default="8")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default="bench/results/comm.json")
    p.add_argument("--plot", default="")
    p.add_argument("--label", default="")
    return p.parse_args(argv)


def config_from(ns: argparse.Namespace) -> SweepConfig:
    return SweepConfig(
        ops=tuple(filter(None, ns.ops.split(","))),
        algorithms=tuple(filter(None, ns.algorithms.split(","))),
        min_bytes=parse_size(ns.min_bytes),
        max_bytes=parse_size(ns.max_bytes),
        dtype=ns.dtype,
        iters=ns.iters,
        warmup=ns.warmup,
    )


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    cfg = config_from(ns)
    with Parallel(strategy="ddp", timeout_s=cfg.timeout_s) as par:
        backend = dist.get_backend()
        title = (
            f"{ns.label + ': ' if ns.label else ''}{par.world_size} ranks, {backend}, {cfg.dtype}"
        )
        rows = sweep(
            cfg,
            progress=lambda r: par.print(
                f"  {r.op:<14} {r.algorithm:<7} {report.human_bytes(r.bytes):>9} "
                f"{r.time_us:>12,.1f} us  busbw {r.busbw_gbs:8.3f} GB/s  wrong {r.wrong}"
            ),
        )
        if par.is_main:
            report.print_table(rows, title)
            fitted = report.fits(rows)
            for name, fit in fitted.items():
                par.print(
                    f"alpha-beta fit {name}: alpha {fit.alpha_us:,.1f} us, "
                    f"bandwidth {fit.bandwidth_gbs:.3f} GB/s"
                )
            memcpy = memcpy_gbs()
            par.print(f"local limit: a 256 MB memcpy runs at {memcpy:.2f} GB/s")
            payload = {
                "command": " ".join(sys.argv),
                "label": ns.label,
                "backend": backend,
                "world_size": par.world_size,
                "machine": report.machine_info(),
                "memcpy_gbs": memcpy,
                "rows": [r.as_dict() for r in rows],
                "fits": {k: vars(v) for k, v in fitted.items()},
            }
            report.write_json(Path(ns.json), payload)
            if ns.plot:
                report.plot(rows, Path(ns.plot), title)
            par.print(f"wrote {ns.json}" + (f" and {ns.plot}" if ns.plot else ""))
        wrong = any(r.wrong for r in rows)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
