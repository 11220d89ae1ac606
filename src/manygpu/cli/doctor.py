"""``manygpu doctor``: is this machine (or cluster) ready for multi-GPU training?

Local: probe this machine, check the facts, and run a short live test on the
local workers (every GPU, or 2 CPU processes on gloo) through ``manygpu
launch``. ``--all-ranks`` runs the whole doctor under the launcher instead, on
every node, and compares the nodes. ``--ray ADDRESS`` reports a Ray cluster's
nodes instead (connecting as a Ray driver, bounded by ``--op-timeout``). Exit
code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from manygpu.cli.launch import add_launch_options, launch_job
from manygpu.cli.notes import Notes, add_quiet
from manygpu.errors import UsageError
from manygpu.flags import parse_size, positive_float

if TYPE_CHECKING:
    from manygpu.doctor.config import LiveConfig
    from manygpu.doctor.report import DoctorReport
    from manygpu.doctor.result import CheckResult

MAX_NBYTES = 1 << 30
RENDEZVOUS_TIMEOUT_S = 120.0

HELP = """Find set-up problems before they become a hang: versions of CUDA, the
driver, cuDNN, NCCL and PyTorch; GPUs, their health and peer-to-peer access;
/dev/shm, limits, the network interface gloo and NCCL would pick; and a live
all-reduce and point-to-point test between every pair of ranks. Each finding
comes with a one-line fix. --all-ranks runs it under the launcher on every
node (give the same launch options as for training) and compares the nodes.
--ray ADDRESS reports a Ray cluster instead: its nodes, their CPUs, GPUs and
memory, and whether each runs the Ray Train that manygpu[ray] pins."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check that this machine / cluster is ready for multi-GPU training",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-live", action="store_true", help="skip the live communication test")
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help="run under the launcher on every rank (and node) and compare them",
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="report the Ray cluster at ADDRESS (its head's HOST:6379, ray://..., or auto) "
        "instead of this machine",
    )
    # No default here: it lives with the doctor's config, in a package that imports torch.
    op_timeout = p.add_argument("--op-timeout", type=positive_float)
    p.help_later(op_timeout, _op_timeout_help)
    p.add_argument("--p2p-bytes", default="4M", help="bytes each way per rank pair (default 4M)")
    add_quiet(p)
    add_launch_options(p)
    p.set_defaults(run=run)


def _op_timeout_help() -> str:
    from manygpu.doctor.config import DEFAULT_OP_TIMEOUT_S

    return f"seconds each live operation may take (default {DEFAULT_OP_TIMEOUT_S:g})"


def live_config(ns: argparse.Namespace, nbytes: int, fmt: str, out: str) -> LiveConfig:
    """What every launched rank of the doctor runs."""
    from manygpu.doctor.config import LiveConfig

    given = {} if ns.op_timeout is None else {"op_timeout_s": ns.op_timeout}
    return LiveConfig(format=fmt, out=out, nbytes=nbytes, live=not ns.no_live, **given)


def _launch_live(ns: argparse.Namespace, config: LiveConfig) -> int:
    from manygpu.runtime import handoff

    env = handoff.worker_env(config)
    return launch_job(ns, "manygpu.doctor.live", True, (), worker_env=env)


def validate(ns: argparse.Namespace) -> int:
    """Bad input fails here, in a second; returns the p2p size in bytes."""
    nbytes = parse_size(ns.p2p_bytes, "--p2p-bytes")
    if not 4 <= nbytes <= MAX_NBYTES:
        raise UsageError(f"--p2p-bytes {ns.p2p_bytes} is outside 4 bytes .. 1G")
    if not ns.all_ranks and (ns.nnodes or ns.node_rank or ns.master_addr or ns.rdzv_endpoint):
        raise UsageError(
            "--nnodes / --node-rank / --master-addr / --rdzv-endpoint need --all-ranks "
            "(the local doctor checks this machine only)"
        )
    if ns.ray is not None and ns.all_ranks:
        raise UsageError("--ray reports a Ray cluster, --all-ranks a launched job: give one")
    return nbytes


def run(ns: argparse.Namespace) -> int:
    nbytes = validate(ns)
    if ns.ray is not None:
        return ray_cluster(ns)
    if ns.timeout_s is None:
        # A node that cannot reach the rendezvous (firewall, wrong address)
        # should be reported in minutes, not after the launcher's 15.
        ns.timeout_s = RENDEZVOUS_TIMEOUT_S
    note = Notes.of("manygpu doctor", ns)
    if ns.all_ranks:
        note("running the doctor on every rank under the launcher, then comparing them")
        return _launch_live(ns, live_config(ns, nbytes, "json" if ns.json else "text", ""))
    note("probing this machine: PyTorch, CUDA, GPUs, limits, network")
    from manygpu.doctor import probes
    from manygpu.doctor.checks import run_checks
    from manygpu.doctor.report import DoctorReport

    facts = probes.gather()
    checks = run_checks(facts)
    report = DoctorReport(nodes=[facts], checks=checks)
    if not ns.no_live:
        note(
            "live test: starting the local workers for an all-reduce and a send/receive "
            "between every pair (--no-live skips it)"
        )
        report.live, live_checks = local_live(ns, nbytes)
        report.checks += live_checks
    show(report, as_json=ns.json)
    return report.exit_code


def ray_cluster(ns: argparse.Namespace) -> int:
    """``--ray``: the cluster's nodes and their checks, this machine's facts left out."""
    from manygpu.doctor.config import DEFAULT_OP_TIMEOUT_S
    from manygpu.doctor.ray_checks import check_ray
    from manygpu.doctor.ray_cluster import probe
    from manygpu.doctor.report import DoctorReport

    timeout_s = DEFAULT_OP_TIMEOUT_S if ns.op_timeout is None else ns.op_timeout
    Notes.of("manygpu doctor", ns)(
        f"connecting to the Ray cluster at {ns.ray} as a driver (at most {timeout_s:g}s) "
        "and asking each node what it runs"
    )
    cluster = probe(ns.ray, timeout_s)
    report = DoctorReport(nodes=[], checks=check_ray(cluster), ray=cluster)
    show(report, as_json=ns.json)
    return report.exit_code


def local_live(ns: argparse.Namespace, nbytes: int) -> tuple[Any, list[CheckResult]]:
    """The live test on this machine's workers, through the real launcher."""
    from manygpu.doctor.crosscheck import check_live
    from manygpu.doctor.report import DoctorReport
    from manygpu.doctor.result import fail

    with tempfile.TemporaryDirectory(prefix="manygpu-doctor-") as tmp:
        out = Path(tmp) / "report.json"
        code = _launch_live(ns, live_config(ns, nbytes, "none", str(out)))
        if code != 0 or not out.is_file():
            return None, [
                fail(
                    "live",
                    f"the live test's workers failed (exit code {code}); their errors are above",
                    "fix the failing checks first; then run manygpu launch with a small script "
                    "to see the error in full",
                )
            ]
        worker = DoctorReport.from_dict(json.loads(out.read_text()))
    if worker.live is None:
        return None, []
    return worker.live, check_live(worker.live)


def show(report: DoctorReport, *, as_json: bool) -> None:
    from manygpu.doctor.report import render, terminal_console

    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
        return
    render(report, terminal_console())
