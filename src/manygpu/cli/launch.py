"""``manygpu launch``: torchrun-compatible, with GPU selection and clear errors."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from manygpu.cli.parser import nonnegative_int, positive_float, positive_int
from manygpu.errors import UsageError
from manygpu.launch import LaunchRequest, launch, resolve
from manygpu.launch.spec import TorchrunOptions
from manygpu.runtime import env as envmod

HELP = """Start SCRIPT (or -m MODULE) once per worker, like torchrun.

Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and GROUP_RANK, so any torchrun script runs unchanged. Defaults:
one worker per local GPU, or 2 CPU workers (gloo) on a machine without GPUs.
Under Slurm (srun, one task per node) the nodes and master come from Slurm."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="run a script on many devices / nodes",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # Everything after SCRIPT is the script's: no prefix of ours may claim
        # its flags ("--n 64" is not an ambiguous "--nnodes"/"--nproc-per-node").
        allow_abbrev=False,
    )
    add_launch_options(p)
    add_torchrun_options(p)
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        dest="is_module",
        help="run ENTRY as a module, like python -m",
    )
    p.add_argument("entry", metavar="SCRIPT", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(run=run)


def add_launch_options(p: argparse.ArgumentParser) -> None:
    """Where and how many workers: shared by every command that launches a job."""
    p.add_argument("--gpus", help="GPUs to use, e.g. 0,1 or all (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=positive_int,
        dest="nproc_per_node",
        help="workers on this node (default: GPUs, or 2 on CPU)",
    )
    p.add_argument("--nnodes", help="nodes: N, or MIN:MAX for an elastic job")
    p.add_argument("--node-rank", "--node_rank", type=positive_int, dest="node_rank")
    p.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        help="address of node 0 (static rendezvous)",
    )
    p.add_argument("--master-port", "--master_port", type=positive_int, dest="master_port")
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        help="HOST:PORT of the c10d rendezvous (elastic jobs)",
    )
    p.add_argument(
        "--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", choices=("c10d", "static")
    )
    p.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", help="job id shared by all nodes")
    p.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        help="rendezvous settings KEY=VALUE,... (e.g. last_call_timeout=5)",
    )
    p.add_argument(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        help="address this node announces to the others",
    )
    p.add_argument(
        "--max-restarts", "--max_restarts", type=positive_int, default=0, dest="max_restarts"
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        dest="timeout_s",
        help=(
            "seconds before a stuck collective fails (manygpu's own, and every process "
            "group a script creates without timeout=; default: 180 for manygpu's, torch's "
            "30 min for others) or nodes stop waiting for each other (default 300)"
        ),
    )
    p.add_argument("--log-dir", "--log_dir", dest="log_dir", help="keep workers' logs here")
    p.add_argument(
        "--term-timeout",
        type=nonnegative_int,
        default=120,
        dest="term_timeout_s",
        help="seconds stopped workers get between SIGTERM and SIGKILL, e.g. to "
        "save a checkpoint on preemption (default 120)",
    )


def add_torchrun_options(p: argparse.ArgumentParser) -> None:
    """torchrun's own flags, with torchrun's meaning (its spellings with - and _)."""
    flag: dict[str, Any] = {"action": "store_true"}
    p.add_argument("--standalone", **flag, help="one node, private rendezvous (the default)")
    p.add_argument(
        "--no-python",
        "--no_python",
        dest="no_python",
        **flag,
        help="run SCRIPT as an executable, not with python",
    )
    p.add_argument(
        "--run-path",
        "--run_path",
        dest="run_path",
        **flag,
        help="run SCRIPT with runpy.run_path (what manygpu does anyway)",
    )
    p.add_argument("-t", "--tee", help="also log these streams: 0-3 or per rank 0:1,1:2")
    p.add_argument("-r", "--redirects", help="log these streams only: 0-3 or per rank 0:1,1:2")
    p.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        dest="local_ranks_filter",
        help="show only these local ranks' output, e.g. 0 or 0,2",
    )
    p.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        dest="monitor_interval",
        type=positive_float,
        default=0.1,
        help="seconds between worker checks",
    )
    p.add_argument("--role", default="worker", help="the workers' role name")
    p.add_argument(
        "--start-method",
        "--start_method",
        dest="start_method",
        default="spawn",
        choices=("spawn", "fork", "forkserver"),
    )


def _ranks(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    parts = [t.strip() for t in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise UsageError(f"--local-ranks-filter {text!r}: give local ranks like 0 or 0,2")
    return tuple(int(p) for p in parts)


def torchrun_options(ns: argparse.Namespace) -> TorchrunOptions:
    """The torchrun flags of ``ns`` (defaults for commands that do not take them)."""
    return TorchrunOptions(
        no_python=getattr(ns, "no_python", False),
        tee=getattr(ns, "tee", None),
        redirects=getattr(ns, "redirects", None),
        local_ranks_filter=_ranks(getattr(ns, "local_ranks_filter", None)),
        monitor_interval=getattr(ns, "monitor_interval", 0.1),
        role=getattr(ns, "role", "worker"),
        start_method=getattr(ns, "start_method", "spawn"),
    )


def run(ns: argparse.Namespace) -> int:
    return launch_job(ns, ns.entry, ns.is_module, tuple(ns.args))


def launch_job(ns: argparse.Namespace, entry: str, is_module: bool, args: tuple[str, ...]) -> int:
    """Launch ``entry`` with the launch options parsed into ``ns``."""
    request = LaunchRequest(
        entry=entry,
        is_module=is_module,
        args=args,
        gpus=ns.gpus,
        nproc_per_node=ns.nproc_per_node,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_backend=ns.rdzv_backend,
        rdzv_id=ns.rdzv_id,
        rdzv_conf=ns.rdzv_conf,
        local_addr=ns.local_addr,
        max_restarts=ns.max_restarts,
        term_timeout_s=ns.term_timeout_s,
        timeout_s=ns.timeout_s,
        log_dir=ns.log_dir,
        standalone=getattr(ns, "standalone", False),
        torchrun=torchrun_options(ns),
    )
    spec = resolve(request, envmod.current(), torch.cuda.device_count())
    return launch(spec)
