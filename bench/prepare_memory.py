"""How much host memory does each rank need to prepare a model and train one step?

Starts N ranks through ``python -m manygpu launch`` (so each sees what a
user's job sees, the launcher's allocator settings included) and meters every
rank's resident set, phase by phase, above its own baseline taken after the
process group exists and before the model is built (``VmHWM``, reset at each
phase through ``/proc/self/clear_refs``; see ``prepare_memory_worker.py``).

Modes (``--mode``, one or several):

- ``whole``: today's path: every rank builds the model with values, then
  ``Parallel(strategy=...)`` + ``par.prepare(model, opt)``;
- ``meta-manual``: the floor, by hand: the model built on the meta device,
  ``fully_shard`` per block then the root, ``to_empty``, each shard initialised
  (fsdp and hsdp only);
- ``init_module``: ``with par.init_module(): model = ...`` then
  ``par.prepare(model, opt, weights=PATH)`` (a safetensors file this script
  writes first); skipped with a note where ``Parallel`` has no ``init_module``.

Strategies (``--strategies``): ``fsdp``, ``hsdp`` (``mesh={"dp": 2, "fsdp": 2}``),
``tensor`` (``mesh={"tp": 4}``), ``dp2xtp2`` (``mesh={"dp": 2, "tp": 2}``).
The model is a GPT (q/k/v/out and fc1/fc2 projections, a ModuleList of blocks,
a tied head) of ``--size`` GB of fp32 parameters at width ``--dim``.

Run::

    .venv/bin/python bench/prepare_memory.py                         # 1 GB, 4 ranks, fsdp + hsdp
    .venv/bin/python bench/prepare_memory.py --size 0.2 --mode whole meta-manual
    .venv/bin/python bench/prepare_memory.py --env MALLOC_ARENA_MAX=2  # a user's own setting

``--cap-groups KIND:DIR,...`` with ``--cap-extra BYTES`` puts rank r under the
memory cgroup DIR number r (made by the caller, of KIND ``cgroup1`` or ``cgroup2``),
limited to what the rank holds when it starts plus BYTES: a rank given less than
the whole model must still prepare and train (tests/launch/test_big_model_memory.py).

``--in-process`` applies manygpu's remedy by hand in every rank (a fixed mmap
threshold, ``malloc_trim`` after prepare: :mod:`manygpu.runtime.host_memory`)
for runs where ``Parallel`` does not apply it itself (``meta-manual``).

Results: a table on stdout and JSON (default ``bench/results/prepare_memory.json``)
with the command line, the machine, every rank's phases and the rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
WORKER = HERE / "prepare_memory_worker.py"
MODES = ("whole", "meta-manual", "init_module")
STRATEGIES = ("fsdp", "hsdp", "tensor", "dp2xtp2", "pipeline")
MANUAL = ("fsdp", "hsdp")
"""What ``meta-manual`` writes by hand: FSDP2 over a 1-D or a 2-D mesh."""


def has_init_module() -> bool:
    """Whether this manygpu's ``Parallel`` builds models on the meta device yet."""
    from manygpu import Parallel

    return hasattr(Parallel, "init_module")


def write_weights(args: argparse.Namespace, folder: Path, strategy: str) -> str:
    """The model's weights as one safetensors file, written in a child process (the
    pipeline's ``nn.Sequential`` layout has its own names)."""
    kind = "pipeline" if strategy == "pipeline" else "gpt"
    path = folder / f"{kind}.safetensors"
    if path.exists():
        return str(path)
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import prepare_memory_worker as w;"
        "from safetensors.torch import save_model; torch.manual_seed(0);"
        "save_model(w.build({'size_gb': float(sys.argv[2]), 'dim': int(sys.argv[3]),"
        " 'strategy': sys.argv[5]}), sys.argv[4])"
    )
    cmd = [sys.executable, "-c", code, str(HERE), str(args.size), str(args.dim), str(path), kind]
    subprocess.run(cmd, check=True)
    return str(path)


def run_one(
    args: argparse.Namespace, mode: str, strategy: str, weights: str | None
) -> dict[str, Any]:
    """Launch the ranks once; every rank's record, or why the run failed."""
    with tempfile.TemporaryDirectory(prefix="prepare-memory-") as out:
        cfg = {
            "mode": mode, "strategy": strategy, "size_gb": args.size, "dim": args.dim,
            "out_dir": out, "weights": weights, "trim": args.trim,
            "in_process": args.in_process, "cap_extra": args.cap_extra,
        }  # fmt: skip
        if args.cap_groups:
            kind, dirs = args.cap_groups.split(":", 1)
            cfg |= {"cap_kind": kind, "cap_dirs": dirs.split(",")}
        cmd = [
            sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", str(args.nproc),
            str(WORKER), "--config", json.dumps(cfg),
        ]  # fmt: skip
        env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env)}
        try:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout}s"}
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        if done.returncode != 0 or len(ranks) != args.nproc:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            return {"error": f"exit code {done.returncode}", "output_tail": tail}
        return {"ranks": ranks}


def summarize(mode: str, strategy: str, result: dict[str, Any]) -> dict[str, Any]:
    """One row: the model's bytes, the highest rank's peak, its ratio, each phase's peak."""
    row: dict[str, Any] = {"mode": mode, "strategy": strategy}
    if "ranks" not in result:
        return {**row, "note": result.get("note") or result.get("error")}
    ranks = result["ranks"]
    size = ranks[0]["model_bytes"]
    names = [p["phase"] for p in ranks[0]["phases"]]
    phases = {
        name: {
            "peak": max(r["phases"][i]["peak"] for r in ranks),
            "rss_after": max(r["phases"][i]["rss_after"] for r in ranks),
        }
        for i, name in enumerate(names)
    }
    peak = max(r["peak"] for r in ranks)
    return {
        **row, "model_bytes": size, "peak_bytes": peak, "ratio": peak / size,
        "phases": phases, "allocator_env": ranks[0]["env"],
        "losses": [r.get("loss") for r in ranks],
        "cap_limits": [r.get("cap_limit") for r in ranks],
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="Peak RSS per rank above its baseline (max over ranks), x model bytes")
    for col in ("mode", "strategy", "model", "peak / rank", "ratio", "phases: peak / after"):
        t.add_column(col)
    for r in rows:
        if "ratio" not in r:
            t.add_row(r["mode"], r["strategy"], "", "", "", f"[yellow]{r['note']}")
            continue
        size = r["model_bytes"]
        phases = "  ".join(
            f"{n} {p['peak'] / size:.2f}/{p['rss_after'] / size:.2f}"
            for n, p in r["phases"].items()
        )
        t.add_row(
            r["mode"], r["strategy"], f"{size / 1e9:.2f} GB", f"{r['peak_bytes'] / 1e9:.2f} GB",
            f"{r['ratio']:.2f}x", phases,
        )  # fmt: skip
    return t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=["fsdp", "hsdp"])
    p.add_argument("--size", type=float, default=1.0, help="model's fp32 GB (default 1.0)")
    p.add_argument("--dim", type=int, default=1024, help="model width (default 1024)")
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="a variable for the launch (e.g. a user's MALLOC_ARENA_MAX=2)")  # fmt: skip
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) after every phase")
    p.add_argument("--in-process", action="store_true",
                   help="fix glibc's mmap threshold in each rank first (runtime.host_memory."
                   "fix_mmap_threshold), then malloc_trim(0) after prepare")  # fmt: skip
    p.add_argument(
        "--cap-groups",
        metavar="KIND:DIR,...",
        help="a memory cgroup per rank, each rank capped at its own RSS + --cap-extra",
    )
    p.add_argument(
        "--cap-extra",
        type=int,
        default=0,
        metavar="BYTES",
        help="what a capped rank may add to what it holds at its start",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per launch, seconds")
    p.add_argument("--out", type=Path, default=HERE / "results" / "prepare_memory.json")
    args = p.parse_args(argv)
    if any("=" not in kv for kv in args.env):
        p.error("--env takes KEY=VALUE")
    if args.cap_groups and not args.cap_groups.startswith(("cgroup1:", "cgroup2:")):
        p.error("--cap-groups takes cgroup1:DIR,... or cgroup2:DIR,...")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="prepare-memory-weights-") as folder:
        for mode in args.mode:
            for strategy in args.strategies:
                if mode == "meta-manual" and strategy not in MANUAL:
                    result: dict[str, Any] = {"note": "meta-manual writes fsdp and hsdp only"}
                elif mode == "init_module" and not has_init_module():
                    result = {"note": "skipped: this Parallel has no init_module yet"}
                else:
                    weights = None
                    if mode == "init_module":
                        weights = write_weights(args, Path(folder), strategy)
                    result = run_one(args, mode, strategy, weights)
                rows.append(summarize(mode, strategy, result))
                if "output_tail" in result:
                    print(result["output_tail"], file=sys.stderr)
                Console().print(table(rows[-1:]))
    Console().print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": sys.argv,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rows": rows,
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
