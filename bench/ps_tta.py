"""Time-to-accuracy: ring all-reduce (ddp) vs sync and async parameter servers, with and
without a straggler, each beside the planner's prediction.

Runs ``bench/ps_tta_worker.py`` under ``manygpu launch`` on this machine, once
per configuration: ddp on N processes; parameter servers on the same N (the
first serves, ``--ps 1``, the others train), sync and async; each with every
worker alike, then with one worker slowed by ``--slow-ms`` per step.

The prediction is :func:`manygpu.plan.uneven_hosts.samples_per_s` for hosts with
the compute time per step measured in the uniform ddp run (plus the sleep on
the slow worker) and a link of ``--link-gbit``; the predicted time to
accuracy assumes every configuration needs as many samples as the uniform
ddp run did (async parameter servers may need more: the table shows both).

    python bench/ps_tta.py [--procs 4] [--epochs 6] [--slow-ms 200] [--link-gbit 10]

Prints a table and writes ``--json`` (default bench/results/ps_tta.json, which
the emulated-cluster version also writes: pass ``--json /tmp/...`` to keep it).
The emulated-cluster version, ``bench/ps_tta_hosts.py`` (hosts with shaped
links, one process per host), runs the same worker script on each host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from manygpu.plan.uneven_hosts import HostRates, samples_per_s

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "ps_tta_worker.py"
CONFIGS = [("ddp", "sync"), ("ps", "sync"), ("ps", "async")]


def run_one(strategy: str, mode: str, args: argparse.Namespace, slow: bool, out: Path) -> dict:
    """One launched job; its first worker's JSON."""
    launch = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", str(args.procs)]
    if strategy == "ps":
        launch += ["--ps", "1"]
    cmd = [*launch, str(WORKER), str(out), "--strategy", strategy, "--mode", mode]
    cmd += ["--epochs", str(args.epochs), "--batch", str(args.batch), "--target", str(args.target)]
    if slow:
        cmd += ["--slow-rank", str(args.slow_worker), "--slow-ms", str(args.slow_ms)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run(cmd, check=True, env=env, timeout=1800)
    return dict(json.loads(out.read_text()))


def predict(row: dict[str, Any], base: dict[str, Any], args: argparse.Namespace) -> float:
    """The planner's samples/s for ``row``'s configuration on hosts like this run's."""
    slow_ms = row["slow_ms"] if row["slow_rank"] >= 0 else 0.0
    servers = 1 if row["strategy"] == "ps" else 0
    hosts = [HostRates(compute_s=base["step_compute_s"], bw_gbs=args.link_gbit / 8)
             for _ in range(args.procs)]  # fmt: skip
    slow_host = servers + row["slow_rank"]
    if slow_ms and 0 <= slow_host < len(hosts):
        hosts[slow_host] = HostRates(compute_s=base["step_compute_s"] + slow_ms / 1e3,
                                bw_gbs=args.link_gbit / 8)  # fmt: skip
    return samples_per_s(row["strategy"], hosts, batch=row["batch"],
                         grad_bytes=row["param_bytes"], weight_bytes=row["param_bytes"],
                         latency_us=args.latency_us, servers=servers,
                         mode=row["mode"] or "sync")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--slow-ms", type=float, default=200.0)
    p.add_argument("--slow-worker", type=int, default=1, help="the slowed worker's index")
    p.add_argument("--link-gbit", type=float, default=10.0, help="link of the prediction")
    p.add_argument("--latency-us", type=float, default=50.0)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "ps_tta.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for slow in (False, True):
            for i, (strategy, mode) in enumerate(CONFIGS):
                out = Path(tmp) / f"{strategy}-{mode}-{int(slow)}.json"
                rows.append(run_one(strategy, mode, args, slow, out) | {"config": i})
    base = rows[0]
    for row in rows:
        row["predicted_samples_per_s"] = predict(row, base, args)
        if base["tta_samples"]:
            row["predicted_tta_s"] = base["tta_samples"] / row["predicted_samples_per_s"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows},
                                    indent=1))  # fmt: skip
    print(f"{'run':<22}{'tta s':>9}{'pred s':>9}{'samples/s':>11}{'pred':>9}{'tta samples':>13}")
    for row in rows:
        parts = [row["strategy"], row["mode"] or "", "+slow" if row["slow_rank"] >= 0 else ""]
        name = " ".join(p for p in parts if p)
        tta = f"{row['tta_s']:.1f}" if row["tta_s"] else "-"
        pred = f"{row.get('predicted_tta_s', 0):.1f}" if row.get("predicted_tta_s") else "-"
        rates = f"{row['samples_per_s']:>11,.0f}{row['predicted_samples_per_s']:>9,.0f}"
        print(f"{name:<22}{tta:>9}{pred:>9}{rates}{row['tta_samples'] or '-':>13}")


if __name__ == "__main__":
    main()
