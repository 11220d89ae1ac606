"""Views on ``bench train`` runs: speed-up and efficiency, a markdown table, a plot, JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from manygpu.bench.train import RunStats


@dataclass(frozen=True, kw_only=True)
class ScalingRow:
    """One worker count, with speed-up and efficiency against the smallest count."""

    run: RunStats
    speedup: float
    """Throughput / the baseline's throughput."""
    efficiency: float
    """Speed-up / (workers / baseline workers): 1.0 is ideal linear scaling."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self.run) | {"speedup": self.speedup, "efficiency": self.efficiency}


def scaling(runs: Sequence[RunStats]) -> list[ScalingRow]:
    """Rows in worker order; the run with the fewest workers is the baseline."""
    if not runs:
        return []
    ordered = sorted(runs, key=lambda r: r.workers)
    base = ordered[0]
    rows = []
    for run in ordered:
        speedup = run.samples_per_s / base.samples_per_s
        rows.append(
            ScalingRow(run=run, speedup=speedup, efficiency=speedup * base.workers / run.workers)
        )
    return rows


COLUMNS = (
    "workers",
    "samples/s",
    "speed-up",
    "efficiency",
    "step ms",
    "compute ms",
    "exposed comm ms",
    "data wait ms",
    "MFU",
)


def _cells(row: ScalingRow) -> list[str]:
    r = row.run
    mfu = "n/a" if r.mfu is None else f"{r.mfu:.1%}"
    return [
        str(r.workers),
        f"{r.samples_per_s:,.1f}",
        f"{row.speedup:.2f}x",
        f"{row.efficiency:.1%}",
        f"{r.step_s * 1e3:,.1f}",
        f"{r.compute_s * 1e3:,.1f}",
        f"{r.comm_s * 1e3:,.1f}",
        f"{r.data_s * 1e3:,.2f}",
        mfu,
    ]


def title(rows: Sequence[ScalingRow]) -> str:
    """What was run, for the table and plot headings."""
    if not rows:
        return "bench train (no runs)"
    r = rows[0].run
    flops = f", {r.flops_per_step / 1e9:,.3g} GFLOP/step/worker" if r.flops_per_step else ""
    precision = r.precision + (" (TF32)" if r.tf32 and r.precision == "fp32" else "")
    compiled = ", compiled" if r.compiled else ""
    return (
        f"{r.model} ({r.parameters / 1e6:.2f}M params), batch {r.batch_per_worker}/worker, "
        f"{precision}{compiled}, {r.device}, {r.threads_per_worker} thread(s)/worker{flops}"
    )


NOTE = (
    "step = compute + exposed comm + data wait. compute is measured on no-sync steps "
    "(no gradient all-reduce) and capped at step - data wait; exposed comm is the rest."
)
"""How the columns relate, printed under the table."""


def markdown(rows: Sequence[ScalingRow]) -> str:
    """A GitHub table (numbers right-aligned) under a one-line heading."""
    lines = [f"**{title(rows)}**", "", "| " + " | ".join(COLUMNS) + " |"]
    lines.append("|" + "|".join("---:" for _ in COLUMNS) + "|")
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join([*lines, "", NOTE]) + "\n"


def table(rows: Sequence[ScalingRow]) -> Table:
    out = Table(title=title(rows), caption=NOTE)
    for name in COLUMNS:
        out.add_column(name, justify="right")
    for row in rows:
        out.add_row(*_cells(row))
    return out


def print_table(rows: Sequence[ScalingRow]) -> None:
    Console(soft_wrap=True, width=160).print(table(rows))


def plot(rows: Sequence[ScalingRow], path: Path) -> None:
    """Throughput and efficiency vs workers, against ideal linear scaling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [r.run.workers for r in rows]
    base = rows[0].run
    ideal = [base.samples_per_s * w / base.workers for w in workers]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(workers, [r.run.samples_per_s for r in rows], marker="o", label="measured")
    left.plot(workers, ideal, linestyle="--", color="grey", label="ideal (linear)")
    left.set_xlabel("workers")
    left.set_ylabel("samples/s")
    left.legend()
    right.plot(workers, [100 * r.efficiency for r in rows], marker="o", label="measured")
    right.axhline(100, linestyle="--", color="grey", label="ideal")
    right.set_ylim(0, 110)
    right.set_xlabel("workers")
    right.set_ylabel("scaling efficiency (%)")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(workers)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title(rows), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def payload(rows: Sequence[ScalingRow], command: str, machine: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: the method, the machine and every row."""
    return {
        "command": command,
        "machine": machine,
        "method": (
            "step = compute + exposed comm + data wait; data wait = time in next(loader); "
            "compute = no-sync step - data wait, capped at step - data wait (the raw value: "
            "nosync_compute_s); exposed comm = step - compute - data wait; "
            "efficiency = speed-up / (workers / base workers)"
        ),
        "rows": [row.as_dict() for row in rows],
    }
