"""``manygpu bench comm``: collective bandwidth, nccl-tests style, under the launcher."""

from __future__ import annotations

import argparse
from typing import Any

from manygpu.bench.comm import ALGOS, OPS, SweepConfig
from manygpu.bench.comm_worker import parse_size
from manygpu.cli import bench_train
from manygpu.cli.launch import add_launch_options, launch_job
from manygpu.cli.parser import OneLineParser
from manygpu.flags import nonnegative_int


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (comm, train)")
    kinds = p.add_subparsers(
        dest="bench", metavar="KIND", parser_class=OneLineParser, required=True
    )
    c = kinds.add_parser(
        "comm",
        help="collective bandwidth sweep (nccl-tests conventions)",
        description="Sweep message sizes for each collective and all-reduce "
        "algorithm (native, ring, parameter server, tree); print size, count, "
        "time, algbw, busbw and #wrong; write JSON and optionally a PNG plot.",
    )
    add_launch_options(c)
    c.add_argument("--ops", default="all_reduce", help=f"comma list of: {', '.join(OPS)}")
    c.add_argument(
        "--algorithms", default=",".join(ALGOS), help=f"all-reduce algorithms: {', '.join(ALGOS)}"
    )
    c.add_argument("--min-bytes", default="8", help="smallest message, e.g. 8, 1K, 1M")
    c.add_argument("--max-bytes", default="64M", help="largest message (doubling from min)")
    c.add_argument("--dtype", default="float32")
    c.add_argument("--iters", type=nonnegative_int, default=0, help="timed iterations (0: adapt)")
    c.add_argument("--warmup", type=nonnegative_int, default=2)
    c.add_argument("--json", default="bench/results/comm.json")
    c.add_argument("--plot", default="", help="also write a busbw-vs-size PNG here")
    c.add_argument("--label", default="", help="a name for this run in the table and JSON")
    c.set_defaults(run=run_comm)
    bench_train.add_kind(kinds)


def run_comm(ns: argparse.Namespace) -> int:
    # Validate here, so bad input fails in a second instead of inside every worker.
    SweepConfig(
        ops=tuple(ns.ops.split(",")),
        algorithms=tuple(ns.algorithms.split(",")),
        min_bytes=parse_size(ns.min_bytes),
        max_bytes=parse_size(ns.max_bytes),
        dtype=ns.dtype,
    )
    args = (
        "--ops",
        ns.ops,
        "--algorithms",
        ns.algorithms,
        "--min-bytes",
        ns.min_bytes,
        "--max-bytes",
        ns.max_bytes,
        "--dtype",
        ns.dtype,
        "--iters",
        str(ns.iters),
        "--warmup",
        str(ns.warmup),
        "--json",
        ns.json,
        "--plot",
        ns.plot,
        "--label",
        ns.label,
    )
    return launch_job(ns, "manygpu.bench.comm_worker", True, args)
