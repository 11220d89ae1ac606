"""Gather facts from the real sources: torch, NVML, /proc, /sys, the network.

Every probe is bounded and fenced: one that fails leaves its facts unknown
(``None``) and records why in ``Facts.errors``; none raises, none blocks for
long (name resolution runs in a thread with a deadline; there are no
subprocesses). GPU probes live in :mod:`manygpu.doctor.gpu`.
"""

from __future__ import annotations

import os
import platform
import resource
import socket
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

from manygpu.doctor.facts import (
    UNLIMITED,
    DriverFacts,
    Facts,
    InterfaceFacts,
    LimitsFacts,
    NetworkFacts,
    RDMAPort,
    SystemFacts,
    TorchFacts,
)
from manygpu.doctor.gpu import probe as probe_gpus
from manygpu.doctor.netpick import pick_gloo, pick_nccl
from manygpu.runtime import env as envmod
from manygpu.runtime.device import cpu_count
from manygpu.runtime.env import Environ

T = TypeVar("T")

GPU_TIMEOUT_S = 30.0
"""NVML and CUDA answer in well under a second unless a GPU or the driver is stuck."""
RESOLVE_TIMEOUT_S = 3.0
"""A hostname lookup slower than this is a finding in itself (a broken DNS)."""

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "CUDA_", "HIP_", "ROCR_", "MANYGPU_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "UCX_NET_DEVICES")

SYS_NET = Path("/sys/class/net")
SYS_IB = Path("/sys/class/infiniband")


class ProbeTimeout(Exception):
    """A probe did not answer within its deadline."""


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` in a daemon thread; give up after ``timeout_s`` (the thread is left)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"probe-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ProbeTimeout(f"{what} did not answer within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def gather(env: Environ | None = None, *, full: bool = True) -> Facts:
    """Every fact about this machine. ``full=False`` skips per-GPU processes and
    the GPU topology (for ranks other than the first of a node)."""
    environ = envmod.current() if env is None else env
    errors: dict[str, str] = {}
    torch_facts = probe_torch(errors)
    try:
        # A GPU that fell off the bus can stall NVML or CUDA for minutes.
        driver, gpus, links = bounded(
            lambda: probe_gpus(torch_facts, errors, full=full), GPU_TIMEOUT_S, "GPU probe"
        )
    except ProbeTimeout as exc:
        driver, gpus, links = DriverFacts(error=str(exc)), [], []
        errors["gpus"] = f"{exc}: is a GPU hung? (dmesg | grep -i xid)"
    return Facts(
        system=probe_system(errors),
        torch=torch_facts,
        driver=driver,
        gpus=gpus,
        links=links,
        network=probe_network(environ, errors),
        limits=probe_limits(errors),
        env=relevant_env(environ),
        errors=errors,
    )


def relevant_env(env: Environ) -> dict[str, str]:
    """The variables that steer CUDA, NCCL, gloo and torch.distributed."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def probe_system(errors: dict[str, str]) -> SystemFacts:
    facts = SystemFacts(
        hostname=socket.gethostname(),
        kernel=platform.release(),
        python=platform.python_version(),
        cpus=cpu_count(),
    )
    try:
        facts.os = os_name(Path("/etc/os-release").read_text())
    except OSError as exc:
        errors["os"] = str(exc)
        facts.os = platform.system()
    try:
        facts.memory_bytes = int(psutil.virtual_memory().total)
    except Exception as exc:
        errors["memory"] = str(exc)
    return facts


def os_name(os_release: str) -> str:
    """``PRETTY_NAME`` from the text of /etc/os-release."""
    for line in os_release.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "PRETTY_NAME":
            return value.strip().strip('"')
    return ""


def probe_torch(errors: dict[str, str]) -> TorchFacts:
    import torch
    import torch.distributed as dist

    version = torch.version
    facts = TorchFacts(
        version=torch.__version__,
        cuda=version.cuda,
        hip=getattr(version, "hip", None),
        build="rocm" if getattr(version, "hip", None) else "cuda" if version.cuda else "cpu",
        nccl_available=dist.is_available() and dist.is_nccl_available(),
        gloo_available=dist.is_available() and dist.is_gloo_available(),
    )
    try:
        cudnn = torch.backends.cudnn.version()
        facts.cudnn = format_cudnn(cudnn) if cudnn else None
    except Exception as exc:
        errors["cudnn"] = str(exc)
    if facts.build != "cpu":
        try:
            facts.nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
        except Exception as exc:
            errors["nccl"] = str(exc)
        try:
            facts.arch_list = list(torch.cuda.get_arch_list())
        except Exception as exc:
            errors["arch_list"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            facts.cuda_available = bool(torch.cuda.is_available())
            facts.device_count = torch.cuda.device_count() if facts.cuda_available else 0
        except Exception as exc:
            facts.cuda_error = str(exc).strip().splitlines()[0]
    if not facts.cuda_available and facts.cuda_error is None and caught:
        facts.cuda_error = str(caught[0].message).strip().splitlines()[0]
    return facts


def format_cudnn(number: int) -> str:
    """``90100`` -> ``9.1.0``; ``8902`` -> ``8.9.2`` (cuDNN 8 used 1000*major)."""
    if number >= 10000:
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number // 100 % 10}.{number % 100}"


def probe_limits(errors: dict[str, str]) -> LimitsFacts:
    facts = LimitsFacts()
    try:
        st = os.statvfs("/dev/shm")
        facts.shm_bytes = st.f_blocks * st.f_frsize
        facts.shm_free_bytes = st.f_bavail * st.f_frsize
    except OSError as exc:
        errors["shm"] = f"/dev/shm: {exc.strerror}"
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        facts.open_files, facts.open_files_hard = _limit(soft), _limit(hard)
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        facts.memlock_bytes = _limit(soft)
    except (OSError, ValueError) as exc:
        errors["limits"] = str(exc)
    return facts


def _limit(value: int) -> int:
    return UNLIMITED if value == resource.RLIM_INFINITY else int(value)


def probe_network(env: Environ, errors: dict[str, str]) -> NetworkFacts:
    facts = NetworkFacts()
    try:
        facts.interfaces = probe_interfaces()
    except Exception as exc:
        errors["interfaces"] = str(exc)
    host = socket.gethostname()
    try:
        facts.hostname_addresses = bounded(lambda: resolve(host), RESOLVE_TIMEOUT_S, "resolve")
    except (OSError, ProbeTimeout) as exc:
        facts.hostname_error = f"{host}: {exc}"
    gloo = pick_gloo(env.get("GLOO_SOCKET_IFNAME"), facts.hostname_addresses, facts.interfaces)
    facts.gloo_interface, facts.gloo_address, facts.gloo_reason = gloo
    facts.nccl_interfaces, facts.nccl_reason = pick_nccl(
        env.get("NCCL_SOCKET_IFNAME"), facts.interfaces
    )
    try:
        facts.rdma = probe_rdma(SYS_IB)
    except OSError as exc:
        errors["rdma"] = str(exc)
    return facts


def resolve(host: str) -> list[str]:
    """Addresses ``host`` resolves to, IPv4 first, without duplicates."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    found: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for fam, _, _, _, sockaddr in infos:
            if fam == family and sockaddr[0] not in found:
                found.append(str(sockaddr[0]))
    return found


def probe_interfaces() -> list[InterfaceFacts]:
    """Interfaces from psutil, plus those only /sys/class/net lists."""
    addrs = psutil.net_if_addrs()
    stats = psutil.net_if_stats()
    names = set(addrs) | set(stats)
    if SYS_NET.is_dir():
        names |= {p.name for p in SYS_NET.iterdir()}
    out = []
    for name in sorted(names):
        st = stats.get(name)
        ips = [
            a.address.split("%")[0]
            for a in addrs.get(name, [])
            if a.family in (socket.AF_INET, socket.AF_INET6)
        ]
        flags = getattr(st, "flags", "") if st else ""
        out.append(
            InterfaceFacts(
                name=name,
                addresses=ips,
                is_up=bool(st and st.isup),
                is_loopback="loopback" in flags or name == "lo",
                speed_mbps=(st.speed or None) if st else None,
                mtu=st.mtu if st else None,
            )
        )
    return out


def probe_rdma(root: Path) -> list[RDMAPort]:
    """InfiniBand / RoCE ports as the kernel lists them under ``root``."""
    if not root.is_dir():
        return []
    ports = []
    for dev in sorted(root.iterdir()):
        net = dev / "device" / "net"
        netdevs = sorted(p.name for p in net.iterdir()) if net.is_dir() else []
        for port in sorted((dev / "ports").glob("*"), key=lambda p: int(p.name)):
            ports.append(
                RDMAPort(
                    device=dev.name,
                    port=int(port.name),
                    state=_read(port / "state").partition(":")[2].strip(),
                    rate=_read(port / "rate"),
                    link_layer=_read(port / "link_layer"),
                    netdev=netdevs[0] if netdevs else None,
                )
            )
    return ports


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
