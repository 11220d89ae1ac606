"""The doctor's report: data first (``--json`` prints it), then a text view.

The text view is rich tables (colour where the terminal supports it): the
machine(s), the GPUs, the GPU topology, the live links, and the checks with
their fixes, most severe first.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from manygpu.doctor.facts import Facts, LiveResults, from_dict
from manygpu.doctor.ray_cluster import RayCluster
from manygpu.doctor.result import SEVERITY, CheckResult, Status, human_bytes, worst

STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


@dataclass
class DoctorReport:
    """Facts of every node, every check's verdict, and the live test's results."""

    nodes: list[Facts]
    checks: list[CheckResult] = field(default_factory=list)
    live: LiveResults | None = None
    ray: RayCluster | None = None
    """The Ray cluster ``--ray`` asked about (its nodes instead of this machine's facts)."""

    @property
    def status(self) -> Status:
        return worst(self.checks)

    @property
    def exit_code(self) -> int:
        """1 when any check failed, else 0."""
        return 1 if self.status == "fail" else 0

    def to_dict(self) -> dict[str, Any]:
        counts = {s: sum(c.status == s for c in self.checks) for s in SEVERITY}
        return {
            "status": self.status,
            "counts": counts,
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "nodes": [n.to_dict() for n in self.nodes],
            "live": dataclasses.asdict(self.live) if self.live else None,
            "ray": dataclasses.asdict(self.ray) if self.ray else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DoctorReport:
        return cls(
            nodes=[Facts.from_dict(n) for n in data.get("nodes", [])],
            checks=[from_dict(CheckResult, c) for c in data.get("checks", [])],
            live=from_dict(LiveResults, data["live"]) if data.get("live") else None,
            ray=RayCluster.from_dict(data["ray"]) if data.get("ray") else None,
        )


def _or(value: object, unknown: str = "?") -> str:
    return unknown if value is None or value == "" else str(value)


def _limit(value: int | None) -> str:
    return "?" if value is None else "unlimited" if value < 0 else str(value)


def machine_table(nodes: list[Facts]) -> Table:
    """One column per node: what runs there."""
    table = Table(title="Machine" if len(nodes) == 1 else "Nodes", title_justify="left")
    table.add_column("")
    for n in nodes:
        table.add_column(n.system.hostname)
    rows: list[tuple[str, Any]] = [
        ("OS / kernel", lambda f: f"{f.system.os} / {f.system.kernel}"),
        ("CPUs / memory", lambda f: f"{f.system.cpus} / {human_bytes(f.system.memory_bytes or 0)}"),
        ("Python", lambda f: f.system.python),
        ("PyTorch", lambda f: f"{f.torch.version} ({f.torch.build} build)"),
        (
            "CUDA (torch / driver)",
            lambda f: f"{_or(f.torch.cuda, '-')} / {_or(f.driver.cuda, '-')}",
        ),
        ("driver", lambda f: _or(f.driver.version, f.driver.error or "-")),
        ("cuDNN / NCCL", lambda f: f"{_or(f.torch.cudnn, '-')} / {_or(f.torch.nccl, '-')}"),
        ("GPUs", lambda f: str(len(f.gpus)) if f.gpus else "none"),
        ("/dev/shm", lambda f: human_bytes(f.limits.shm_bytes or 0)),
        (
            "ulimit -n / -l",
            lambda f: (
                f"{_limit(f.limits.open_files)} / "
                + (
                    "unlimited"
                    if (f.limits.memlock_bytes or 0) < 0
                    else human_bytes(f.limits.memlock_bytes or 0)
                )
            ),
        ),
        ("hostname resolves to", lambda f: ", ".join(f.network.hostname_addresses) or "nothing"),
        (
            "gloo interface",
            lambda f: f"{_or(f.network.gloo_interface)} ({_or(f.network.gloo_address)})",
        ),
        ("NCCL interfaces", lambda f: ", ".join(f.network.nccl_interfaces) or "none"),
        (
            "interfaces up",
            lambda f: ", ".join(i.name for i in f.network.interfaces if i.is_up) or "none",
        ),
        ("RDMA ports", lambda f: _rdma(f) or "none"),
    ]
    for label, get in rows:
        table.add_row(label, *(get(n) for n in nodes))
    return table


def _rdma(f: Facts) -> str:
    return ", ".join(f"{p.device}/{p.port} {p.state} {p.rate}".strip() for p in f.network.rdma)


def gpu_table(f: Facts) -> Table:
    table = Table(title=f"GPUs on {f.system.hostname}", title_justify="left")
    for name in (
        "#",
        "name",
        "memory",
        "cc",
        "temp",
        "power",
        "SM clock",
        "ECC",
        "NVLinks",
        "in use",
    ):
        table.add_column(name, justify="left" if name in ("name", "in use") else "right")
    for g in f.gpus:
        mem = (
            f"{human_bytes(g.memory_used_bytes or 0)} / {human_bytes(g.memory_total_bytes)}"
            if g.memory_total_bytes
            else "?"
        )
        power = (
            f"{g.power_w:.0f} / {g.power_limit_w:.0f} W" if g.power_w and g.power_limit_w else "?"
        )
        clock = f"{_or(g.sm_clock_mhz)} / {_or(g.sm_clock_max_mhz)}"
        ecc = "off" if g.ecc_enabled is False else _or(g.ecc_uncorrected_errors, "on")
        busy = ", ".join(f"{p.pid} {p.name}".strip() for p in g.processes) or "-"
        table.add_row(
            str(g.index),
            g.name,
            mem,
            _or(g.compute_capability),
            f"{g.temperature_c} C" if g.temperature_c is not None else "?",
            power,
            clock,
            ecc,
            _or(g.nvlinks_active),
            busy,
        )
    return table


def topology_table(f: Facts) -> Table:
    """nvidia-smi topo -m's matrix; a ``!`` marks a pair without P2P access."""
    n = max([len(f.gpus), *(max(link.a, link.b) + 1 for link in f.links)])
    cell = {(link.a, link.b): link for link in f.links}
    table = Table(title=f"GPU topology on {f.system.hostname} (! = no P2P)", title_justify="left")
    table.add_column("")
    for j in range(n):
        table.add_column(f"GPU{j}", justify="center")
    for i in range(n):
        row = []
        for j in range(n):
            link = cell.get((min(i, j), max(i, j)))
            if i == j:
                row.append("X")
            elif link is None:
                row.append("?")
            else:
                row.append(link.path + ("!" if link.p2p is False else ""))
        table.add_row(f"GPU{i}", *row)
    return table


def live_table(live: LiveResults) -> Table:
    table = Table(
        title=f"Live test: {live.world_size} ranks, {live.backend}, "
        f"{human_bytes(live.nbytes)} each way per pair",
        title_justify="left",
    )
    for name in ("ranks", "hosts", "time (ms)", "GB/s", "error"):
        table.add_column(name, justify="right" if name in ("time (ms)", "GB/s") else "left")
    for p in live.pairs:
        hosts = live.hosts
        where = f"{hosts[p.a]} <-> {hosts[p.b]}" if max(p.a, p.b) < len(hosts) else "?"
        table.add_row(
            f"{p.a} <-> {p.b}",
            where,
            f"{p.seconds * 1e3:.2f}" if p.seconds is not None else "-",
            f"{p.gbps:.3f}" if p.gbps is not None else "-",
            p.error or "",
        )
    return table


def ray_table(cluster: RayCluster) -> Table:
    """One row per node of the Ray cluster: where it is, what Ray offers, what it runs."""
    title = f"Ray cluster at {cluster.address} (Ray {_or(cluster.ray)})"
    table = Table(title=title, title_justify="left")
    for name in ("node", "IP", "", "CPUs", "GPUs", "memory", "Ray", "Ray Train", "torch"):
        table.add_column(name, justify="right" if name in ("CPUs", "GPUs") else "left")
    for n in cluster.nodes:
        soft = n.software
        train = "?" if soft is None else "ok" if soft.train_error is None else "missing"
        gpus = f"{n.gpus:g}" + (f" {n.accelerator}" if n.accelerator else "")
        table.add_row(
            n.host or n.node_id[:8],
            n.ip,
            ("head" if n.head else "") + ("" if n.alive else " dead"),
            f"{n.cpus:g}",
            gpus,
            human_bytes(n.memory_bytes) if n.memory_bytes else "?",
            _or(soft.ray if soft else None),
            train,
            _or(soft.torch if soft else None),
        )
    return table


def checks_table(checks: list[CheckResult]) -> Table:
    table = Table(title="Checks", title_justify="left")
    multi = len({c.host for c in checks}) > 1
    table.add_column("status")
    table.add_column("check")
    if multi:
        table.add_column("node")
    table.add_column("finding")
    table.add_column("fix")
    ordered = sorted(checks, key=lambda c: -SEVERITY[c.status])
    for c in ordered:
        status = f"[{STYLE[c.status]}]{c.status.upper()}[/]"
        host = [c.host] if multi else []
        table.add_row(status, c.name, *host, c.message, c.fix)
    return table


def terminal_console() -> Console:
    """A terminal's own width; 120 columns in a pipe or a log (rich would use 80)."""
    out = Console(file=sys.stdout, highlight=False)
    if not out.is_terminal:
        out = Console(file=sys.stdout, highlight=False, width=120)
    return out


def render(report: DoctorReport, console: Console) -> None:
    """Print the report as tables (colour only when ``console`` is a terminal)."""
    if report.nodes:  # none when only a Ray cluster was asked about
        console.print(machine_table(report.nodes))
    if report.ray is not None and report.ray.nodes:
        console.print(ray_table(report.ray))
    for f in report.nodes:
        if f.gpus:
            console.print(gpu_table(f))
        if len(f.gpus) > 1 or f.links:
            console.print(topology_table(f))
    if report.nodes and not any(f.gpus for f in report.nodes):
        console.print("No GPU here: checked the CPU / gloo path.")
    if report.live is not None:
        console.print(live_table(report.live))
    console.print(checks_table(report.checks))
    counts = {s: sum(c.status == s for c in report.checks) for s in SEVERITY}
    status = report.status
    console.print(
        f"[{STYLE[status]}]{status.upper()}[/]: {counts['ok']} ok, {counts['warn']} warn, "
        f"{counts['fail']} fail"
    )
