"""``manygpu launch``: torchrun-compatible, with GPU selection and clear errors.

The options are declared once, on the fields of :mod:`manygpu.launch.spec`;
this module adds them to argparse and builds the request back by field name.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from manygpu.cli.launch_extras import add_extras, apply_extras
from manygpu.cli.parser import add_flags, given_flags
from manygpu.errors import UsageError
from manygpu.launch.entry import script_problem
from manygpu.launch.spec import (
    HostOptions,
    LaunchRequest,
    LaunchSpec,
    Placement,
    ProgramOptions,
    TorchrunOptions,
)

HELP = """Start SCRIPT (or -m MODULE) once per worker, like torchrun.

Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and GROUP_RANK, so any torchrun script runs unchanged. Defaults:
one worker per local GPU, or 2 CPU workers (gloo) on a machine without GPUs.
Under Slurm (srun, one task per node) the nodes and master come from Slurm,
and under mpirun (one launcher per node: mpirun --map-by ppr:1:node) from MPI.

Many machines from one command: -H host1:4,host2:4 (or --hostfile FILE)
starts this launcher on every host over ssh (hosts named as this machine run
here), all meeting at the first host; -np N caps the processes in all."""


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
    add_flags(p, HostOptions)
    add_extras(p)
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        dest="is_module",
        help="run ENTRY as a module, like python -m",
    )
    p.add_argument("entry", metavar="SCRIPT", nargs="?", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(run=run)


def add_launch_options(p: argparse.ArgumentParser) -> None:
    """Where and how many workers: shared by every command that launches a job."""
    add_flags(p, Placement)
    add_flags(p, ProgramOptions)


def add_torchrun_options(p: argparse.ArgumentParser) -> None:
    """torchrun's own flags, with torchrun's meaning (its spellings with - and _)."""
    add_flags(p, LaunchRequest, only=("standalone",))
    add_flags(p, TorchrunOptions)


def torchrun_options(ns: argparse.Namespace) -> TorchrunOptions:
    """The torchrun flags of ``ns`` (defaults for commands that do not take them)."""
    return TorchrunOptions(**given_flags(TorchrunOptions, ns))


def launch_request(
    ns: argparse.Namespace,
    entry: str,
    is_module: bool,
    args: tuple[str, ...],
    worker_env: dict[str, str] | None = None,
) -> LaunchRequest:
    """The request for ``entry`` from the launch options parsed into ``ns``."""
    return LaunchRequest(
        entry=entry,
        is_module=is_module,
        args=args,
        torchrun=torchrun_options(ns),
        worker_env=worker_env or {},
        **given_flags(LaunchRequest, ns),
    )


def run(ns: argparse.Namespace) -> int:
    if ns.entry is None:
        raise UsageError(
            "give the script to run: manygpu launch [options] train.py [ARGS...] "
            "(or -m MODULE); see manygpu launch --help"
        )
    hosts = HostOptions(**given_flags(HostOptions, ns))
    if not hosts.given and not ns.is_module and not getattr(ns, "no_python", False):
        problem = script_problem(ns.entry)  # before torch loads: a typo costs no seconds
        if problem is not None:
            raise UsageError(problem)
    extra_env = apply_extras(ns, local=not hosts.given)
    if hosts.given:
        request = launch_request(ns, ns.entry, ns.is_module, tuple(ns.args), extra_env)
        return launch_hosts(request, hosts)
    if hosts.np is not None:
        # Horovod's `horovodrun -np 2 python train.py`: processes on this machine.
        if ns.nproc_per_node not in (None, hosts.np):
            raise UsageError(
                f"-np {hosts.np} and --nproc-per-node {ns.nproc_per_node} disagree; give one"
            )
        ns.nproc_per_node = hosts.np
    return launch_job(ns, ns.entry, ns.is_module, tuple(ns.args), extra_env)


def launch_hosts(request: LaunchRequest, hosts: HostOptions) -> int:
    """Run ``request`` on the hosts of ``hosts`` from here, over ssh."""
    import os

    from manygpu.launch.hosts.run import launch_hosts as run_on_hosts
    from manygpu.runtime import env as envmod

    return run_on_hosts(request, hosts, envmod.current(), os.getcwd())


def launch_job(
    ns: argparse.Namespace,
    entry: str,
    is_module: bool,
    args: tuple[str, ...],
    worker_env: dict[str, str] | None = None,
) -> int:
    """Launch ``entry`` with the launch options parsed into ``ns``."""
    return launch_spec(resolve_request(launch_request(ns, entry, is_module, args, worker_env)))


def resolve_request(request: LaunchRequest) -> LaunchSpec:
    """Resolve ``request`` against this process's environment and GPUs (imports torch)."""
    import torch

    from manygpu.launch.resolve import resolve
    from manygpu.runtime import env as envmod

    return resolve(request, envmod.current(), torch.cuda.device_count())


def launch_spec(spec: LaunchSpec) -> int:
    """Run the resolved job under torch's elastic agent; its exit code."""
    from manygpu.launch.agent import launch
    from manygpu.launch.resolve import threads_note

    for note in (spec.note, threads_note(spec)):
        if note:
            print(f"manygpu: {note}", file=sys.stderr, flush=True)
    return launch(spec)
