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
from manygpu.bench.comm import CommBenchConfig, CommRow, memcpy_bytes, memcpy_gbs, sweep
from manygpu.core.parallel import Parallel
from manygpu.runtime import handoff

PLAIN = {"markup": False, "highlight": False, "soft_wrap": True}
"""Rows as plain fixed-width lines: no colours, no wrapping at the terminal's width."""


def main(config: CommBenchConfig) -> int:
    """Sweep on every rank; rank 0 prints each row once and writes what was asked for.

    Exit code 1: a wrong result.
    """
    cfg, label = config.sweep, config.label
    with Parallel(strategy="ddp", timeout_s=cfg.timeout_s) as par:
        backend = dist.get_backend()
        title = f"{label + ': ' if label else ''}{par.world_size} ranks, {backend}, {cfg.dtype}"
        for line in (title, report.header_line()):
            par.print(line, **PLAIN)
        rows = sweep(cfg, progress=lambda r: par.print(report.row_line(r), **PLAIN))
        if par.is_main:
            fitted = report.fits(rows)
            for name, fit in fitted.items():
                par.print(
                    f"alpha-beta fit {name}: alpha {fit.alpha_us:,.1f} us, "
                    f"bandwidth {report.human_rate(fit.bandwidth_gbs)}"
                )
            probe = memcpy_bytes(cfg.max_bytes)
            memcpy = memcpy_gbs(probe)
            par.print(
                f"local limit: a {report.size_label(probe)} memcpy runs at "
                f"{report.human_rate(memcpy)}"
            )
            _write(config, par.world_size, backend, rows, fitted, memcpy)
        wrong = any(r.wrong for r in rows)
    return 1 if wrong else 0


def _write(
    config: CommBenchConfig,
    world_size: int,
    backend: str,
    rows: list[CommRow],
    fitted: dict[str, report.AlphaBeta],
    memcpy: float,
) -> None:
    """The JSON, the plot and the markdown table, each only when a path was given (never
    into the current directory uninvited)."""
    written = []
    label = config.label + ": " if config.label else ""
    title = f"{label}{world_size} ranks, {backend}, {config.sweep.dtype}"
    if config.json_path:
        payload = {
            "command": config.command,
            "sweep": asdict(config.sweep),  # every setting, defaults included
            "label": config.label,
            "backend": backend,
            "world_size": world_size,
            "machine": report.machine_info(),
            "memcpy_gbs": memcpy,
            "memcpy_bytes": memcpy_bytes(config.sweep.max_bytes),
            "rows": [r.as_dict() for r in rows],
            "fits": {k: vars(v) for k, v in fitted.items()},
        }
        report.write_json(Path(config.json_path), payload)
        written.append(config.json_path)
    if config.plot:
        report.plot(rows, Path(config.plot), title)
        written.append(config.plot)
    if config.markdown:
        path = Path(config.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report.markdown(rows, title))
        written.append(config.markdown)
    if written:
        print(f"wrote {' and '.join(written)}")


if __name__ == "__main__":
    sys.exit(main(handoff.received(CommBenchConfig)))
