"""Ring vs parameter server vs the backend's all-reduce across emulated hosts.

Creates N hosts (network namespaces on a bridge, each link shaped to a rate
with tc), runs ``manygpu bench comm`` as an N-node job with one process per
host, and compares the measured times with the bandwidth model:

    parameter server: the server's link carries (N-1)·S in, then (N-1)·S out
                      -> t = 2(N-1)·S / B
    ring:             2(N-1) steps of S/N on every link at once
                      -> t = 2(N-1)/N · S / B   (N times faster at N ranks)

Needs root and iproute2. Usage (about 2 minutes with the defaults):

    python bench/comm_emulated.py [--hosts 4] [--rate 1gbit] [--max-bytes 64M]

Prints a table and writes bench/results/comm_emulated.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from manygpu.bench import report
from manygpu.bench.comm import CommRow
from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

ROOT = Path(__file__).resolve().parents[1]


def rate_bytes_per_s(rate: str) -> float:
    """``"1gbit"`` -> 1.25e8 bytes/s (tc's decimal units)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for suffix, scale in units.items():
        if rate.lower().endswith(suffix):
            return float(rate[: -len(suffix)]) * scale / 8
    raise SystemExit(f"rate {rate!r}: write e.g. 1gbit or 500mbit")


def predicted_s(algorithm: str, nbytes: int, hosts: int, link: float) -> float | None:
    if algorithm == "ring":
        return 2 * (hosts - 1) / hosts * nbytes / link
    if algorithm == "ps":
        return 2 * (hosts - 1) * nbytes / link
    return None


def run(args: argparse.Namespace) -> dict[str, object]:
    out_dir = Path(tempfile.mkdtemp(prefix="mg-emu-"))
    result_json = out_dir / "comm.json"
    env = dict(
        os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src")
    )
    with EmulatedCluster(args.hosts, LinkShape(rate=args.rate)) as cluster:
        argv = [
            [sys.executable, "-m", "manygpu", "bench", "comm", "--nnodes", str(args.hosts),
             "--node-rank", str(i), "--nproc-per-node", "1", "--master-addr",
             cluster.addresses[0], "--master-port", "29571", "--timeout", "300",
             "--ops", "all_reduce", "--algorithms", "native,ring,ps",
             "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes,
             "--iters", str(args.iters), "--warmup", "1",
             "--json", str(result_json), "--label", f"{args.hosts} hosts @ {args.rate}"]
            for i in range(args.hosts)
        ]  # fmt: skip
        procs = cluster.run_all(argv, timeout=args.timeout, env=env)
    for i, proc in enumerate(procs):
        if proc.returncode != 0:
            raise SystemExit(f"host {i} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(result_json.read_text())


def analyse(data: dict[str, object], hosts: int, rate: str) -> dict[str, object]:
    link = rate_bytes_per_s(rate)
    rows = [CommRow(**r) for r in data["rows"]]  # type: ignore[arg-type, union-attr]
    by_size: dict[int, dict[str, CommRow]] = {}
    for r in rows:
        by_size.setdefault(r.bytes, {})[r.algorithm] = r
    lines = []
    for size, algos in sorted(by_size.items()):
        line: dict[str, object] = {"bytes": size}
        for name, row in algos.items():
            pred = predicted_s(name, size, hosts, link)
            line[f"{name}_ms"] = row.time_us / 1e3
            line[f"{name}_busbw_gbs"] = row.busbw_gbs
            if pred is not None:
                line[f"{name}_predicted_ms"] = pred * 1e3
        if "ring" in algos and "ps" in algos:
            line["ps_over_ring"] = algos["ps"].time_us / algos["ring"].time_us
        lines.append(line)
    fits = {k: vars(v) for k, v in report.fits(rows).items()}
    return {
        "hosts": hosts,
        "rate": rate,
        "link_gbs": link / 1e9,
        "sizes": lines,
        "fits": fits,
        "predicted_ps_over_ring": float(hosts),
        "raw": data,
    }


def show(analysis: dict[str, object]) -> None:
    t = Table(
        title=f"all-reduce over {analysis['hosts']} emulated hosts, links "
        f"{analysis['rate']} ({analysis['link_gbs']:.3f} GB/s)"
    )
    for col in (
        "size",
        "native ms",
        "ring ms",
        "ring model ms",
        "ps ms",
        "ps model ms",
        "ps/ring",
        "ring busbw GB/s",
    ):
        t.add_column(col, justify="right")
    for line in analysis["sizes"]:  # type: ignore[attr-defined]
        t.add_row(
            report.human_bytes(line["bytes"]),
            f"{line.get('native_ms', 0):.1f}",
            f"{line['ring_ms']:.1f}",
            f"{line['ring_predicted_ms']:.1f}",
            f"{line['ps_ms']:.1f}",
            f"{line['ps_predicted_ms']:.1f}",
            f"{line['ps_over_ring']:.2f}",
            f"{line['ring_busbw_gbs']:.3f}",
        )
    console = Console(soft_wrap=True, width=160)
    console.print(t)
    for name, fit in analysis["fits"].items():  # type: ignore[attr-defined]
        console.print(
            f"alpha-beta fit {name}: alpha {fit['alpha_us'] / 1e3:.2f} ms, "
            f"bandwidth {fit['bandwidth_gbs']:.4f} GB/s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--min-bytes", default="1M")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "comm_emulated.json"))
    args = p.parse_args()
    ok, why = netns_available()
    if not ok:
        raise SystemExit(f"cannot emulate hosts here: {why}")
    analysis = analyse(run(args), args.hosts, args.rate)
    analysis["command"] = " ".join(sys.argv)
    analysis["machine"] = report.machine_info()
    show(analysis)
    report.write_json(Path(args.json), analysis)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
