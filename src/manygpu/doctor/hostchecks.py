"""Checks of the host around the GPUs: shared memory, limits, network, environment.

Pure functions of :class:`Facts`, like those in :mod:`manygpu.doctor.checks`.
"""

from __future__ import annotations

from collections import Counter

from manygpu.doctor.facts import UNLIMITED, Facts
from manygpu.doctor.netpick import nccl_match
from manygpu.doctor.result import CheckResult, fail, human_bytes, ok, warn

SHM_FAIL_BYTES = 512 << 20
SHM_WARN_BYTES = 2 << 30
OPEN_FILES_WARN = 4096
MEMLOCK_RDMA_MIN = 64 << 20
RISKY_ENV = {
    "NCCL_P2P_DISABLE": "turns off GPU peer-to-peer: traffic between local GPUs goes "
    "through the host",
    "NCCL_SHM_DISABLE": "turns off NCCL's shared-memory transport between local processes",
    "NCCL_IB_DISABLE": "turns off InfiniBand/RoCE: NCCL uses TCP sockets between nodes",
    "CUDA_LAUNCH_BLOCKING": "serialises every CUDA kernel launch (a debugging switch, slow)",
}


def check_shm(f: Facts) -> list[CheckResult]:
    size = f.limits.shm_bytes
    if size is None:
        return [
            fail(
                "shm",
                "/dev/shm is missing: NCCL and DataLoader workers need shared memory",
                "run the container with --shm-size=8g or --ipc=host",
            )
        ]
    msg = f"/dev/shm is {human_bytes(size)}"
    fix = "run the container with --shm-size=8g or --ipc=host"
    if size < SHM_FAIL_BYTES:
        return [fail("shm", msg + ": NCCL and DataLoader workers need more", fix)]
    if size < SHM_WARN_BYTES:
        return [warn("shm", msg + ": enough for small jobs, tight for many workers", fix)]
    return [ok("shm", msg)]


def check_limits(f: Facts) -> list[CheckResult]:
    lim, out = f.limits, []
    nofile = lim.open_files
    if nofile is not None and nofile != UNLIMITED and nofile < OPEN_FILES_WARN:
        out.append(
            warn(
                "open_files",
                f"open-file limit is {nofile}: DataLoader workers and NCCL sockets can run out",
                "ulimit -n 65536 (docker: --ulimit nofile=65536:65536)",
            )
        )
    active = [p for p in f.network.rdma if p.state == "ACTIVE"]
    mem = lim.memlock_bytes
    if active and mem is not None and mem != UNLIMITED and mem < MEMLOCK_RDMA_MIN:
        out.append(
            fail(
                "memlock",
                f"locked-memory limit is {human_bytes(mem)}: RDMA cannot register NCCL's buffers",
                "ulimit -l unlimited (docker: --ulimit memlock=-1; Slurm: PropagateResourceLimits)",
            )
        )
    shown = "unlimited" if nofile == UNLIMITED else nofile
    return out or [ok("limits", f"open files {shown}")]


def check_ifnames(f: Facts) -> list[CheckResult]:
    itfs = f.network.interfaces
    names = [i.name for i in itfs]
    up = {i.name for i in itfs if i.is_up}
    out = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        spec = f.env.get(var)
        if not spec:
            continue
        if var == "GLOO_SOCKET_IFNAME":
            wanted = [p.strip() for p in spec.split(",") if p.strip()]
            matched = [n for n in wanted if n in names]
            missing = [n for n in wanted if n not in names]
        else:
            matched = nccl_match(spec, names)
            missing = [] if matched else [spec]
        loopback = {i.name for i in itfs if i.is_loopback}
        choices = [n for n in names if n in up and n not in loopback] or sorted(up)
        have = ", ".join(choices) or "none"
        if missing:
            out.append(
                fail(
                    "ifname",
                    f"{var}={spec} names an interface that does not exist "
                    f"({', '.join(missing)}; this host has {have})",
                    f"set {var} to the interface on the network the nodes share (one of: {have})",
                )
            )
        elif not any(n in up for n in matched):
            out.append(
                fail(
                    "ifname",
                    f"{var}={spec} names {', '.join(matched)}, which is down",
                    f"bring it up (ip link set {matched[0]} up) or choose one of: {have}",
                )
            )
    return out


def check_network(f: Facts) -> list[CheckResult]:
    net = f.network
    host = f.system.hostname
    out = []
    if net.hostname_error:
        out.append(
            fail(
                "hostname",
                f"hostname does not resolve ({net.hostname_error}): gloo falls back to loopback",
                f"add '{host}' with this node's address to /etc/hosts, or set GLOO_SOCKET_IFNAME",
            )
        )
    lo = {i.name for i in net.interfaces if i.is_loopback}
    real = [i for i in net.interfaces if i.is_up and not i.is_loopback and i.addresses]
    suggest = real[0].name if real else "eth0"
    if net.gloo_interface in lo:
        out.append(
            warn(
                "interface",
                f"gloo would use {net.gloo_interface} ({net.gloo_address}; {net.gloo_reason}): "
                "fine on one node, unreachable from other nodes",
                f"for multi-node jobs set GLOO_SOCKET_IFNAME={suggest} and "
                f"NCCL_SOCKET_IFNAME={suggest}, or map '{host}' to its {suggest} address "
                "in /etc/hosts",
            )
        )
    if f.gpus and net.nccl_interfaces and set(net.nccl_interfaces) <= lo:
        out.append(
            warn(
                "interface",
                f"NCCL would use only {', '.join(net.nccl_interfaces)} ({net.nccl_reason})",
                f"for multi-node jobs set NCCL_SOCKET_IFNAME={suggest}",
            )
        )
    if out:
        return out
    nccl = ", ".join(net.nccl_interfaces) or "none"
    return [
        ok(
            "interface",
            f"gloo: {net.gloo_interface} ({net.gloo_address}; {net.gloo_reason}); NCCL: {nccl}",
        )
    ]


def check_rdma(f: Facts) -> list[CheckResult]:
    ports = f.network.rdma
    if not ports:
        if not f.gpus:
            return []
        return [ok("rdma", "no InfiniBand / RDMA device: NCCL uses TCP between nodes")]
    active = [p for p in ports if p.state == "ACTIVE"]
    if not active:
        return [
            warn(
                "rdma",
                f"{len(ports)} RDMA port(s), none ACTIVE: NCCL falls back to TCP sockets",
                "check cables and the subnet manager (ibstat; systemctl status opensm)",
            )
        ]
    down = [f"{p.device}/{p.port} {p.state or '?'}" for p in ports if p.state != "ACTIVE"]
    rates = Counter(p.rate for p in active)
    summary = f"{len(active)} RDMA port(s) ACTIVE ({', '.join(rates)})"
    if down:
        return [
            warn(
                "rdma",
                f"{summary}; not active: {', '.join(down)}",
                "check those ports (ibstat); NCCL spreads traffic over fewer rails meanwhile",
            )
        ]
    return [ok("rdma", summary)]


def check_env(f: Facts) -> list[CheckResult]:
    out = []
    for var, effect in RISKY_ENV.items():
        if f.env.get(var, "0").strip().lower() not in ("", "0", "false", "no"):
            out.append(warn("env", f"{var}={f.env[var]} {effect}", f"unset {var} unless needed"))
    if f.env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        out.append(
            warn(
                "env",
                "TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective (slow)",
                "unset it outside debugging",
            )
        )
    return out or [ok("env", f"{len(f.env)} relevant variable(s) set, none risky")]
