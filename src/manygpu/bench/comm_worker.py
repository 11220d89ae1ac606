"""The per-rank program of ``manygpu bench comm`` (started by ``manygpu launch``).

Its configuration is the :class:`~manygpu.bench.comm.CommBenchConfig` the
command built and handed over (:mod:`manygpu.runtime.handoff`).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from manygpu.bench import report
from manygpu.bench.comm import CommBenchConfig, memcpy_gbs, sweep
from manygpu.core.parallel import Parallel
from manygpu.runtime import handoff


def main(config: CommBenchConfig) -> int:
    """Sweep on every rank; rank 0 prints and writes the views. Exit code 1: a wrong result."""
    cfg, label = config.sweep, config.label
    with Parallel(strategy="ddp", timeout_s=cfg.timeout_s) as par:
        backend = dist.get_backend()
        title = f"{label + ': ' if label else ''}{par.world_size} ranks, {backend}, {cfg.dtype}"
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
                "command": config.command,
                "sweep": asdict(cfg),  # every setting, defaults included (the command has some)
                "label": label,
                "backend": backend,
                "world_size": par.world_size,
                "machine": report.machine_info(),
                "memcpy_gbs": memcpy,
                "rows": [r.as_dict() for r in rows],
                "fits": {k: vars(v) for k, v in fitted.items()},
            }
            report.write_json(Path(config.json_path), payload)
            if config.plot:
                report.plot(rows, Path(config.plot), title)
            par.print(f"wrote {config.json_path}" + (f" and {config.plot}" if config.plot else ""))
        wrong = any(r.wrong for r in rows)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(handoff.received(CommBenchConfig)))
