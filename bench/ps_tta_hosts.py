"""Time-to-accuracy on emulated hosts: ring (ddp) vs sync and async parameter servers,
with and without a straggler host, each beside the planner's prediction.

Creates N hosts (network namespaces on a bridge, every link shaped to
``--rate`` with tc) and runs ``bench/ps_tta_worker.py`` as an N-node
``manygpu launch`` job, one process per host:

- ddp: every host trains (N workers);
- ps sync / ps async: ``--ps 1``, host 0 serves, hosts 1..N-1 train (N-1 workers);
- the straggler is the last host: its steps are slowed by ``--slow-ms`` of
  sleep after every backward (``--slow-rank`` of the worker), so the same
  host straggles under every strategy; by default 3x the compute per step
  of the first uniform ddp run, so its steps take about 4x as long. (Slowed
  steps, not a slowed link: the demo model's gradient is 1.3 MB, which a
  1 Gbit/s link moves in ~10 ms, a 250 Mbit/s one in ~40 ms, both small
  beside steps of 100+ ms on shared cores, so a slow link would hardly show.)

Cases run interleaved (repeat 1 of every case, then repeat 2, ...) and the
table shows the median. The prediction is
:func:`manygpu.plan.uneven_hosts.samples_per_s` on hosts with the compute time
per step measured in the uniform ddp runs (plus the sleep on the straggler)
and a link of ``--rate``; predicted time to accuracy = the case's own
measured samples-to-target / predicted samples/s, so the ratio
measured/predicted tests the throughput model alone.

Needs root and iproute2. About 6 minutes with the defaults on a 2-core box:

    python bench/ps_tta_hosts.py [--hosts 4] [--rate 1gbit] [--repeats 2]

Writes bench/results/ps_tta.json and bench/results/ps_tta.png, prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from manygpu.bench import report
from manygpu.emulate import EmulatedCluster, LinkShape, netns_available
from manygpu.plan.uneven_hosts import HostRates, samples_per_s

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "ps_tta_worker.py"
CONFIGS = [("ddp", "sync"), ("ps", "sync"), ("ps", "async")]
RESULTS = ROOT / "bench" / "results"


def rate_gbs(rate: str) -> float:
    """``"1gbit"`` -> 0.125 GB/s (tc's decimal units)."""
    for suffix, scale in {"gbit": 1.0, "mbit": 1e-3, "kbit": 1e-6}.items():
        if rate.lower().endswith(suffix):
            return float(rate[: -len(suffix)]) * scale / 8
    raise SystemExit(f"rate {rate!r}: write e.g. 1gbit or 500mbit")


def case_name(strategy: str, mode: str, slow: bool) -> str:
    base = "ddp (ring)" if strategy == "ddp" else f"ps {mode}"
    return f"{base}{' + straggler' if slow else ''}"


def host_argv(
    i: int, strategy: str, mode: str, slow: bool, out: Path, port: int, addr0: str,
    args: argparse.Namespace,
) -> list[str]:  # fmt: skip
    """HostRates ``i``'s ``manygpu launch`` line for one case."""
    argv = [sys.executable, "-m", "manygpu", "launch", "--nnodes", str(args.hosts),
            "--node-rank", str(i), "--nproc-per-node", "1", "--master-addr", addr0,
            "--master-port", str(port), "--timeout", "120"]  # fmt: skip
    if strategy == "ps":
        argv += ["--ps", "1"]
    argv += [str(WORKER), str(out), "--strategy", strategy, "--mode", mode,
             "--epochs", str(args.epochs), "--batch", str(args.batch),
             "--target", str(args.target), "--eval-every", str(args.eval_every)]  # fmt: skip
    if slow:  # the last host: worker index N-1 under ddp, N-2 under one server
        servers = 1 if strategy == "ps" else 0
        argv += ["--slow-rank", str(args.hosts - 1 - servers), "--slow-ms", str(args.slow_ms)]
    return argv


def run_case(
    cluster: EmulatedCluster, strategy: str, mode: str, slow: bool, port: int,
    tmp: Path, args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """One launched job over every host; the first worker's JSON plus timing facts."""
    out = tmp / f"{strategy}-{mode}-{int(slow)}-{port}.json"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", TP_SOCKET_IFNAME="eth0",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))  # fmt: skip
    argv = [host_argv(i, strategy, mode, slow, out, port, cluster.addresses[0], args)
            for i in range(args.hosts)]  # fmt: skip
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    procs = cluster.run_all(argv, timeout=args.run_timeout, env=env)
    wall = time.perf_counter() - began
    failed = [(i, p.returncode, p.stderr[-600:]) for i, p in enumerate(procs) if p.returncode]
    facts = {"case": case_name(strategy, mode, slow), "wall_s": wall,
             "load_before": load_before, "load_after": os.getloadavg()[0]}  # fmt: skip
    if failed or not out.exists():
        return facts | {"error": str(failed)[-1500:] or "no result written"}
    return facts | json.loads(out.read_text())


def predict(case: dict[str, Any], compute_s: float, args: argparse.Namespace) -> float:
    """The planner's samples/s for ``case`` on hosts like the emulated ones."""
    link = rate_gbs(args.rate)
    hosts = [HostRates(compute_s=compute_s, bw_gbs=link) for _ in range(args.hosts)]
    if case["slow"]:
        hosts[-1] = HostRates(compute_s=compute_s + args.slow_ms / 1e3, bw_gbs=link)
    servers = 1 if case["strategy"] == "ps" else 0
    return samples_per_s(case["strategy"], hosts, batch=args.batch,
                         grad_bytes=case["param_bytes"], weight_bytes=case["param_bytes"],
                         latency_us=args.latency_us, servers=servers,
                         mode=case["mode"])  # fmt: skip


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One line per case: medians over repeats, the prediction and measured/predicted."""
    base = [r for r in runs if r["case"] == case_name("ddp", "sync", False) and "error" not in r]
    compute_s = statistics.median(r["step_compute_s"] for r in base) if base else 0.05
    cases = []
    for slow in (False, True):
        for strategy, mode in CONFIGS:
            name = case_name(strategy, mode, slow)
            ok = [r for r in runs if r["case"] == name and "error" not in r]
            case: dict[str, Any] = {"case": name, "strategy": strategy, "mode": mode,
                                    "slow": slow, "runs": len(ok), "reached": sum(
                                        r["tta_s"] is not None for r in ok)}  # fmt: skip
            for key in ("tta_s", "tta_samples", "samples_per_s", "step_compute_s"):
                case[key] = _median(ok, key)
            if ok:
                case["param_bytes"] = ok[0]["param_bytes"]
                case["workers"] = ok[0]["workers"]
                case["predicted_samples_per_s"] = predict(case, compute_s, args)
                case["rate_ratio"] = case["samples_per_s"] / case["predicted_samples_per_s"]
                if case["tta_samples"]:
                    case["predicted_tta_s"] = (case["tta_samples"]
                                               / case["predicted_samples_per_s"])  # fmt: skip
                    case["tta_ratio"] = case["tta_s"] / case["predicted_tta_s"]
            cases.append(case)
    return cases


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def show(cases: list[dict[str, Any]], args: argparse.Namespace) -> None:
    t = Table(
        title=f"time to {args.target:.0%} held-out accuracy, {args.hosts} emulated hosts "
        f"@ {args.rate}, straggler +{args.slow_ms:.0f} ms/step (median of runs)"
    )
    for col in ("case", "workers", "runs (reached)", "tta s", "pred tta s", "tta meas/pred",
                "samples to target", "samples/s", "pred samples/s", "rate meas/pred",
                "compute ms/step"):  # fmt: skip
        t.add_column(col, justify="right")
    for c in cases:
        t.add_row(c["case"], str(c.get("workers", "-")), f"{c['runs']} ({c['reached']})",
                  _f(c["tta_s"], ".2f"), _f(c.get("predicted_tta_s"), ".2f"),
                  _f(c.get("tta_ratio"), ".2f"), _f(c["tta_samples"], ".0f"),
                  _f(c["samples_per_s"], ",.0f"), _f(c.get("predicted_samples_per_s"), ",.0f"),
                  _f(c.get("rate_ratio"), ".2f"),
                  _f(c["step_compute_s"] and c["step_compute_s"] * 1e3, ".1f"))  # fmt: skip
    Console(soft_wrap=True, width=200).print(t)


def plot(cases: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars: measured and predicted time to accuracy per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["case"].replace(" + ", "\n+ ") for c in cases]
    xs = range(len(cases))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar([x - 0.2 for x in xs], [c["tta_s"] or 0 for c in cases], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [c.get("predicted_tta_s") or 0 for c in cases], 0.4,
           label="planner (uneven_hosts.samples_per_s)", alpha=0.7)  # fmt: skip
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("seconds to target accuracy (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--slow-ms", type=float, default=None,
                   help="straggler sleep per step; default 3x the first uniform ddp run's "
                        "compute per step, so the straggler's steps take about 4x")  # fmt: skip
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--run-timeout", type=float, default=150.0, help="seconds cap per run")
    p.add_argument("--latency-us", type=float, default=50.0)
    p.add_argument("--json", type=Path, default=RESULTS / "ps_tta.json")
    p.add_argument("--plot", type=Path, default=RESULTS / "ps_tta.png")
    return p.parse_args()


def main() -> None:
    args = parse()
    ok, why = netns_available()
    if not ok:
        raise SystemExit(f"cannot emulate hosts here: {why}")
    runs: list[dict[str, Any]] = []
    port = 29640
    with tempfile.TemporaryDirectory() as tmp, \
            EmulatedCluster(args.hosts, LinkShape(rate=args.rate)) as cluster:  # fmt: skip
        for rep in range(args.repeats):
            for slow in (False, True):
                for strategy, mode in CONFIGS:
                    port += 1  # a fresh port: no TIME_WAIT from the previous job
                    run = run_case(cluster, strategy, mode, slow, port, Path(tmp), args)
                    if args.slow_ms is None and "error" not in run:
                        args.slow_ms = round(3e3 * run["step_compute_s"])
                    runs.append(run | {"repeat": rep})
                    print(
                        f"[{rep}] {run['case']}: tta {run.get('tta_s')} s, "
                        f"{run.get('samples_per_s') or 0:,.0f} samples/s, wall "
                        f"{run['wall_s']:.0f} s, load {run['load_before']:.1f}"
                        f"{'  ERROR ' + run['error'] if 'error' in run else ''}",
                        flush=True,
                    )
    cases = summarise(runs, args)
    show(cases, args)
    loads = [r["load_before"] for r in runs] + [r["load_after"] for r in runs]
    payload = {"command": " ".join(sys.argv), "args": vars(args) | {
        "json": str(args.json), "plot": str(args.plot)}, "machine": report.machine_info(),
        "load_avg_1min": {"min": min(loads), "max": max(loads)},
        "layout": "1 process per host; ddp: all hosts train; ps: host 0 serves (--ps 1), "
                  "hosts 1.. train; straggler: last host sleeps slow_ms per step",
        "cases": cases, "runs": [{k: v for k, v in r.items() if k != "curve"} | {
            "curve": r.get("curve")} for r in runs]}  # fmt: skip
    report.write_json(args.json, payload)
    plot(cases, args.plot, f"{args.hosts} emulated hosts @ {args.rate}, 2 shared CPU cores; "
                           f"straggler +{args.slow_ms:.0f} ms/step")  # fmt: skip
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
