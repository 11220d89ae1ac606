"""``manygpu bench comm``: collective bandwidth, nccl-tests style, under the launcher."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from manygpu.cli import bench_train
from manygpu.cli.launch import add_launch_options, launch_job
from manygpu.cli.parser import OneLineParser
from manygpu.flags import nonnegative_int, parse_size

if TYPE_CHECKING:
    from manygpu.bench.comm import CommBenchConfig


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
        "time, algbw, busbw and #wrong, one line per measurement; with --json / "
        "--plot / --markdown also write JSON / a PNG plot / a markdown table there "
        "(nothing is written otherwise).",
    )
    add_launch_options(c)
    c.help_later(c.add_argument("--ops", default="all_reduce"), _ops_help)
    # No default here: the algorithms' names live with their code, which imports torch.
    c.help_later(c.add_argument("--algorithms"), _algorithms_help)
    c.add_argument("--min-bytes", default="8", help="smallest message, e.g. 8, 1K, 1M")
    c.add_argument("--max-bytes", default="64M", help="largest message (doubling from min)")
    c.add_argument("--dtype", default="float32")
    c.add_argument("--iters", type=nonnegative_int, default=0, help="timed iterations (0: adapt)")
    c.add_argument("--warmup", type=nonnegative_int, default=2)
    c.add_argument("--json", default="", help="write the results here as JSON (default: no file)")
    c.add_argument("--plot", default="", help="also write a busbw-vs-size PNG here")
    c.add_argument("--markdown", default="", help="also write the table in markdown here")
    c.add_argument("--label", default="", help="a name for this run in the table and JSON")
    c.set_defaults(run=run_comm)
    bench_train.add_kind(kinds)


def _ops_help() -> str:
    from manygpu.bench.comm import OPS

    return f"comma list of: {', '.join(OPS)}"


def _algorithms_help() -> str:
    from manygpu.bench.comm import ALGOS

    return f"all-reduce algorithms: {', '.join(ALGOS)}"


def comm_config(ns: argparse.Namespace) -> CommBenchConfig:
    """The :class:`~manygpu.bench.comm.CommBenchConfig` of ``ns``; bad input fails here,
    in a second, instead of inside every worker."""
    from manygpu.bench.comm import ALGOS, CommBenchConfig, SweepConfig

    algorithms = ",".join(ALGOS) if ns.algorithms is None else ns.algorithms
    sweep = SweepConfig(
        ops=tuple(ns.ops.split(",")),
        algorithms=tuple(algorithms.split(",")),
        min_bytes=parse_size(ns.min_bytes, "--min-bytes"),
        max_bytes=parse_size(ns.max_bytes, "--max-bytes"),
        dtype=ns.dtype,
        iters=ns.iters,
        warmup=ns.warmup,
    )
    command = " ".join(["manygpu", *sys.argv[1:]])
    return CommBenchConfig(
        sweep=sweep,
        json_path=ns.json,
        plot=ns.plot,
        markdown=ns.markdown,
        label=ns.label,
        command=command,
    )


def run_comm(ns: argparse.Namespace) -> int:
    from manygpu.runtime import handoff

    env = handoff.worker_env(comm_config(ns))
    return launch_job(ns, "manygpu.bench.comm_worker", True, (), worker_env=env)
