"""1 -> 2 CPU processes: measured scaling (``manygpu bench train``) vs the planner's prediction.

For each workload, rounds are interleaved (every workload once per round) and
every job uses 1 thread per worker, the 1-process baseline too (per-worker
scaling on a 2-core machine). The planner gets what it would get on any
machine: the parameter count, the measured 1-worker step time, and 'this
machine' measured by its probe (1-thread matmul, 2-process gloo all-reduce
fitted to alpha-beta; no overlap on CPUs). It predicts the 2-worker efficiency,
compared with the median measured one.

    python bench/scaling.py [--rounds 3] [--steps 12]

Prints a table and writes bench/results/scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from manygpu.bench.report import machine_info, write_json  # noqa: E402
from manygpu.plan.desc import ModelDesc  # noqa: E402
from manygpu.plan.hardware import Cluster  # noqa: E402
from manygpu.plan.perf import estimate  # noqa: E402
from manygpu.plan.probe import this_machine  # noqa: E402

WORKLOADS = (("resnet", 32), ("gpt", 16), ("demo-cnn", 32), ("demo-cnn", 8))
"""(model, batch per worker): compute-bound first, communication-bound last."""


def bench_train(model: str, batch: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        cmd = [sys.executable, "-m", "manygpu", "bench", "train", "--model", model,
               "--workers", "1,2", "--threads", "1", "--batch", str(batch),
               "--steps", str(steps), "--warmup", "3", "--block", "3",
               "--json", str(out)]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, text=True)
        return json.loads(out.read_text())["rows"]


def predict(one: dict, cluster: Cluster) -> tuple[float, float]:
    """(efficiency, exposed comm s) for 2 workers from the 1-worker run."""
    desc = ModelDesc(name=one["model"], parameters=one["parameters"], step_compute_s=one["step_s"],
                     compute_batch=one["batch_per_worker"])  # fmt: skip
    est = estimate(desc, cluster, "ddp", batch=one["batch_per_worker"], world=2)
    return est.efficiency, est.exposed_s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {f"{m}@{b}": [] for m, b in WORKLOADS}
    clusters = []
    for r in range(args.rounds):
        clusters.append(this_machine(2))  # probed each round: the machine is shared
        for model, batch in WORKLOADS:
            one, two = bench_train(model, batch, args.steps)
            eff, exposed = predict(one, clusters[-1])
            runs[f"{model}@{batch}"].append({"one": one, "two": two, "predicted_efficiency": eff,
                                             "predicted_exposed_s": exposed})  # fmt: skip
            print(f"round {r + 1} {model}@{batch}: measured {two['efficiency']:.1%}, "
                  f"predicted {eff:.1%}", flush=True)  # fmt: skip
    rows = []
    for key, rs in runs.items():
        measured = statistics.median(x["two"]["efficiency"] for x in rs)
        predicted = statistics.median(x["predicted_efficiency"] for x in rs)
        rows.append({
            "workload": key,
            "parameters": rs[0]["one"]["parameters"],
            "threads_per_worker": rs[0]["one"]["threads_per_worker"],
            "one_samples_per_s": statistics.median(x["one"]["samples_per_s"] for x in rs),
            "two_samples_per_s": statistics.median(x["two"]["samples_per_s"] for x in rs),
            "measured_efficiency": measured,
            "measured_min": min(x["two"]["efficiency"] for x in rs),
            "measured_max": max(x["two"]["efficiency"] for x in rs),
            "step_ms_1": statistics.median(x["one"]["step_s"] for x in rs) * 1e3,
            "compute_ms_2": statistics.median(x["two"]["compute_s"] for x in rs) * 1e3,
            "comm_ms_2": statistics.median(x["two"]["comm_s"] for x in rs) * 1e3,
            "predicted_comm_ms": statistics.median(x["predicted_exposed_s"] for x in rs) * 1e3,
            "predicted_efficiency": predicted,
            "relative_error": predicted / measured - 1,
        })  # fmt: skip
    print(
        "\n| workload | params | 1-worker samples/s | 2-worker samples/s | measured eff. "
        "(min-max) | predicted eff. | pred./meas. - 1 | 2-worker compute ms | exposed comm ms "
        "(measured / predicted) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['parameters'] / 1e6:.2f}M | {r['one_samples_per_s']:,.0f} "
              f"| {r['two_samples_per_s']:,.0f} | {r['measured_efficiency']:.1%} "
              f"({r['measured_min']:.0%}-{r['measured_max']:.0%}) "
              f"| {r['predicted_efficiency']:.1%} "
              f"| {r['relative_error']:+.1%} | {r['compute_ms_2']:.1f} "
              f"| {r['comm_ms_2']:.1f} / {r['predicted_comm_ms']:.1f} |")  # fmt: skip
    c = clusters[0]
    print(f"\nprobe (round 1): {c.peak_tflops * 1e3:.0f} GFLOP/s per 1-thread process, "
          f"gloo alpha {c.intra_latency_us:.0f} us per ring step, "
          f"{c.intra_bw_gbs:.2f} GB/s")  # fmt: skip
    write_json(ROOT / "bench/results/scaling.json", {
        "command": "python bench/scaling.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "probes": [{"peak_tflops": c.peak_tflops, "alpha_us": c.intra_latency_us,
                    "bandwidth_gbs": c.intra_bw_gbs} for c in clusters],
        "rows": rows,
        "runs": runs,
    })  # fmt: skip


if __name__ == "__main__":
    main()
