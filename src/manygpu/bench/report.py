"""Views on benchmark rows: a table, an alpha-beta fit, a plot, JSON."""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.table import Table

from manygpu.bench.comm import CommRow

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} GB"  # pragma: no cover


def human_rate(gbs: float) -> str:
    """A bandwidth given in GB/s (10^9 bytes, nccl-tests' unit) with a unit that keeps
    four significant digits, so an 8-byte message shows ``1.234 MB/s``, not ``0.000``."""
    if not math.isfinite(gbs):
        return "n/a"  # a fit of latency-bound sizes only: no bandwidth to speak of
    value = gbs * 1e9
    for unit in ("B/s", "KB/s", "MB/s", "GB/s"):
        if abs(value) < 1000:
            return f"{value:.4g} {unit}"
        value /= 1000
    return f"{value:.4g} TB/s"


def size_label(n: float) -> str:
    """A message size as people write it: ``8 B``, ``1 KiB``, ``64 MiB`` (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} GiB"  # pragma: no cover


COLUMNS = (
    "op",
    "algorithm",
    "size",
    "count",
    "type",
    "time (us)",
    "algbw",
    "busbw",
    "#wrong",
)
"""nccl-tests' columns: size, count, type, time, algbw, busbw, #wrong (after op and algorithm);
the bandwidths carry their unit in each cell (:func:`human_rate`)."""
_LEFT = ("op", "algorithm", "type")
_WIDTHS = (14, 9, 9, 13, 8, 12, 12, 12, 6)


def cells(r: CommRow) -> list[str]:
    """One row's values as the table shows them."""
    return [
        r.op,
        r.algorithm,
        human_bytes(r.bytes),
        f"{r.count:,}",
        r.dtype,
        f"{r.time_us:,.1f}",
        human_rate(r.algbw_gbs),
        human_rate(r.busbw_gbs),
        str(r.wrong),
    ]


def _line(values: Sequence[str]) -> str:
    parts = [
        v.ljust(w) if name in _LEFT else v.rjust(w)
        for name, v, w in zip(COLUMNS, values, _WIDTHS, strict=True)
    ]
    return "  ".join(parts).rstrip()


def header_line() -> str:
    """The column names, aligned with :func:`row_line` (printed once, before the sweep)."""
    return _line(COLUMNS)


def row_line(r: CommRow) -> str:
    """One measured row as a fixed-width line, printed as soon as it is measured.

    nccl-tests' way: each row appears once, when it is known, so a long sweep
    shows progress and the output is the table (no second copy at the end).
    """
    return _line(cells(r))


def table(rows: Sequence[CommRow], title: str) -> Table:
    """The rows as a rich table (for callers that show them only at the end)."""
    out = Table(title=title)
    for name in COLUMNS:
        out.add_column(name, justify="left" if name in _LEFT else "right")
    for r in rows:
        out.add_row(*cells(r))
    return out


def markdown(rows: Sequence[CommRow], title: str) -> str:
    """The rows as a markdown table under a ``title`` line (what ``--markdown`` writes)."""
    right = [name not in _LEFT for name in COLUMNS]
    lines = [
        f"**{title}**",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---:" if r else ":---" for r in right) + "|",
        *("| " + " | ".join(cells(r)) + " |" for r in rows),
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class AlphaBeta:
    """time = alpha + bytes * beta, fitted by least squares."""

    alpha_us: float
    """Fixed cost per operation (latency), microseconds."""
    bandwidth_gbs: float
    """1 / beta: the bandwidth the operation achieves on large messages, GB/s."""

    def predict_us(self, nbytes: float) -> float:
        return self.alpha_us + nbytes / (self.bandwidth_gbs * 1e3)


def fit_alpha_beta(rows: Sequence[CommRow]) -> AlphaBeta:
    """Fit one op/algorithm's rows (needs two sizes or more)."""
    x = np.array([r.bytes for r in rows], dtype=float)
    y = np.array([r.time_us for r in rows], dtype=float)
    # Relative error matters at every size: weight by 1/time so small messages count.
    beta, alpha = np.polyfit(x, y, 1, w=1.0 / y)
    # Only latency-bound sizes: no slope to speak of, so no bandwidth estimate.
    bandwidth = 1.0 / float(beta) / 1e3 if beta > 0 else float("nan")
    return AlphaBeta(alpha_us=max(float(alpha), 0.0), bandwidth_gbs=bandwidth)


def fits(rows: Sequence[CommRow]) -> dict[str, AlphaBeta]:
    """An alpha-beta fit per ``op/algorithm`` with at least two sizes."""
    groups: dict[str, list[CommRow]] = {}
    for r in rows:
        groups.setdefault(f"{r.op}/{r.algorithm}", []).append(r)
    return {k: fit_alpha_beta(v) for k, v in groups.items() if len({r.bytes for r in v}) >= 2}


def figure(rows: Sequence[CommRow], title: str) -> Figure:
    """busbw vs size, one line per op/algorithm (log-log), sizes labelled ``1 KiB``..."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[str, list[CommRow]] = {}
    for r in rows:
        groups.setdefault(f"{r.op}/{r.algorithm}", []).append(r)
    for name, group in groups.items():
        ax.plot([r.bytes for r in group], [r.busbw_gbs for r in group], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: size_label(x)))
    ax.set_yscale("log")
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot(rows: Sequence[CommRow], path: Path, title: str) -> None:
    """:func:`figure` written to ``path`` as a PNG."""
    fig = figure(rows, title)  # first: it picks the file-only backend before pyplot loads
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_info() -> dict[str, Any]:
    import os

    import torch

    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)


def print_table(rows: Sequence[CommRow], title: str) -> None:
    Console(soft_wrap=True, width=160).print(table(rows, title))
