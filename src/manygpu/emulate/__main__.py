"""``python -m manygpu.emulate --hosts 4 --rate 1gbit -- CMD ...``: run CMD on every host.

In CMD, ``{host}`` becomes the host's index, ``{addr}`` its address and
``{master}`` host 0's address, e.g.

    sudo python -m manygpu.emulate --hosts 2 -- manygpu launch --nnodes 2 \\
        --node-rank {host} --master-addr {master} --nproc-per-node 1 train.py

Exits with the first non-zero exit code; the hosts are always deleted.
"""

from __future__ import annotations

import argparse
import sys

from manygpu.emulate.netns import EmulatedCluster, LinkShape, netns_available
from manygpu.runtime import env as envmod


def build_parser() -> argparse.ArgumentParser:
    """The parser; raw description, so the example keeps its lines in ``--help``."""
    p = argparse.ArgumentParser(
        prog="python -m manygpu.emulate",
        description=(__doc__ or "").replace("``", ""),  # reST quotes read as noise in a terminal
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hosts", type=int, default=2, help="how many hosts to make (default: 2)")
    p.add_argument("--rate", default=None, help="link bandwidth, e.g. 1gbit")
    p.add_argument("--delay", default=None, help="one-way latency, e.g. 1ms (needs netem)")
    p.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds before every host's command is killed (default: 3600)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...: what each host runs")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        p.error("give the command to run after --")
    ok, why = netns_available()
    if not ok:
        print(f"python -m manygpu.emulate: error: {why}", file=sys.stderr)
        return 2
    env = {**envmod.current(), "GLOO_SOCKET_IFNAME": "eth0"}
    with EmulatedCluster(ns.hosts, LinkShape(rate=ns.rate, delay=ns.delay)) as cluster:
        master = cluster.addresses[0]
        argvs = [
            [part.format(host=i, addr=addr, master=master) for part in command]
            for i, addr in enumerate(cluster.addresses)
        ]
        results = cluster.run_all(argvs, timeout=ns.timeout, env=env)
    for i, res in enumerate(results):
        for line in (res.stdout + res.stderr).splitlines():
            print(f"[host{i}] {line}")
    return next((r.returncode for r in results if r.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())
