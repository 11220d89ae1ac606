"""horovod_vs_ddp.py across emulated hosts, launched over ssh with ``manygpu launch -H``.

Creates N hosts (network namespaces on a bridge, every link shaped with tc to
``--rate``), starts a real sshd in hosts 1..N-1 (tests/cluster/ssh_hosts.py:
keys and configs in a temporary directory), and runs on host 0::

    bench/horovod_vs_ddp.py --launch-args "-np N -H h0:1,h1:1,... --ssh-config CFG"

so one rank per host, and every gradient all-reduce crosses the shaped links.
The job compares ``manygpu.horovod.DistributedOptimizer`` with
``Parallel(strategy="ddp")`` in interleaved blocks (see horovod_vs_ddp.py);
afterwards every host must be empty but for its sshd, and everything is torn
down. Needs root, iproute2 and openssh-server (installed when missing).

Run (a few minutes with the defaults)::

    .venv/bin/python bench/horovod_vs_ddp_hosts.py [--hosts 4] [--rate 1gbit] [--model demo-cnn]

Prints the table and writes JSON (default
``bench/results/horovod_vs_ddp_hosts.json``): horovod_vs_ddp.py's report plus
the cluster (hosts, rate) and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests" / "cluster")]

import horovod_vs_ddp  # noqa: E402  (bench/ and tests/cluster are not packages)
from ssh_hosts import SshHosts, ensure_openssh  # noqa: E402

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available  # noqa: E402


def _env() -> dict[str, str]:
    """Gloo on each host's eth0, one thread per rank, this checkout's sources."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT / "src")
    return env


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(ns: argparse.Namespace, bench_args: list[str]) -> dict[str, Any]:
    """Set up the hosts, run the benchmark from host 0, check and tear down."""
    load_before = _load()
    with (
        EmulatedCluster(ns.hosts, LinkShape(rate=ns.rate)) as cluster,
        SshHosts(cluster) as ssh,
        tempfile.TemporaryDirectory(prefix="horovod_vs_ddp_hosts-") as tmp,
    ):
        listed = ",".join(f"{addr}:1" for addr in cluster.addresses)
        launch = f"-np {ns.hosts} -H {listed} --ssh-config {ssh.config} -x OMP_NUM_THREADS=1"
        out = Path(tmp) / "report.json"
        argv = [sys.executable, str(HERE / "horovod_vs_ddp.py"), "--launch-args", launch,
                "--out", str(out), *bench_args]  # fmt: skip
        proc = subprocess.run(
            cluster.command(0, argv), env=_env(), capture_output=True, text=True, cwd=ROOT
        )
        left = ssh.wait_until_clean(range(ns.hosts))
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
            raise SystemExit(f"the benchmark failed (exit {proc.returncode}):\n{tail}")
        if left:
            raise SystemExit(f"processes left on the hosts after the job: {left}")
        report: dict[str, Any] = json.loads(out.read_text())
        addresses = list(cluster.addresses)
    report["benchmark_command"] = report["command"]
    report["command"] = shlex.join([sys.executable, *sys.argv])
    report["cluster"] = {
        "hosts": ns.hosts,
        "ranks_per_host": 1,
        "rate": ns.rate,
        "addresses": addresses,
        "launched_from": "host 0, over ssh to the others",
    }
    report["machine"]["load_average_before"] = load_before
    return report


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other options (--model, --batch, --steps, --warmup, --rounds, --size, "
        "--timeout) go to horovod_vs_ddp.py.",
    )
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts, one rank each")
    p.add_argument("--rate", default="1gbit", help="every link's bandwidth, as tc writes it")
    p.add_argument("--out", type=Path, default=HERE / "results" / "horovod_vs_ddp_hosts.json")
    ns, rest = p.parse_known_args(argv)
    if ns.hosts < 2:
        p.error("--hosts must be >= 2 (one host needs no ssh: use horovod_vs_ddp.py)")
    if any(a.split("=")[0] in ("--launch-args", "--nproc", "--out") for a in rest):
        p.error("--launch-args, --nproc and --out are set here; give --hosts / --rate instead")
    return ns, rest


def main(argv: list[str] | None = None) -> int:
    ns, bench_args = parse_args(argv)
    ok, why = netns_available()
    if not ok:
        raise SystemExit(f"emulated hosts unavailable: {why}")
    why_not = ensure_openssh()
    if why_not is not None:
        raise SystemExit(why_not)
    report = run(ns, bench_args)
    print(f"{ns.hosts} emulated hosts at {ns.rate}, one rank each, launched with -H over ssh")
    print(horovod_vs_ddp.render(report))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"raw results: {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
