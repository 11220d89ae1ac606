"""Process-group set-up and teardown with a timeout a human would wait for.

Without ``manygpu launch`` (``srun``, ``mpirun``: the Slurm or MPI variables
say where each rank stands) rank 0 hosts the job's ``TCPStore`` itself. torch's
``tcp://`` and ``env://`` handlers would bind it to every address of the
machine, where any host that reaches it could write the job's keys; ours
listens on the job's address alone, as the launcher's stores do
(:mod:`manygpu.launch.rendezvous`).
"""

from __future__ import annotations

import datetime as dt
import errno
import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import ClusterInfo

LOOPBACK = "127.0.0.1"
DIRECT_SOURCES = frozenset({"slurm", "mpi"})
"""Launchers whose ranks meet on a store that rank 0 hosts (no agent hosts one)."""


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """Everything a strategy needs to know about the job it runs in."""

    cluster: ClusterInfo
    """Ranks and rendezvous address."""
    device: torch.device
    """The device this process drives."""
    backend: str
    """Collective backend of the default group."""
    timeout_s: float
    """Timeout of every collective and of the rendezvous."""
    owns_group: bool
    """Whether we created the default group, and so must destroy it."""

    @property
    def rank(self) -> int:
        return self.cluster.rank

    @property
    def world_size(self) -> int:
        return self.cluster.world_size


def init_distributed(
    cluster: ClusterInfo,
    *,
    device: torch.device,
    backend: str,
    timeout_s: float,
    force: bool = False,
) -> DistContext:
    """Join (or create) the default process group.

    Args:
        cluster: where this process stands in the job.
        device: this process's device; NCCL binds the group to it so the first
            collective does not guess.
        backend: ``"nccl"``, ``"gloo"``...
        timeout_s: applies to the rendezvous and to every collective.
        force: create a one-process group even when alone, for strategies (DDP)
            that need a group whatever the world size.
    """
    if dist.is_initialized():
        return DistContext(
            cluster=cluster,
            device=device,
            backend=dist.get_backend(),
            timeout_s=timeout_s,
            owns_group=False,
        )
    if cluster.world_size == 1 and not force:
        return DistContext(
            cluster=cluster, device=device, backend=backend, timeout_s=timeout_s, owns_group=False
        )
    _create_group(cluster, device=device, backend=backend, timeout_s=timeout_s)
    return DistContext(
        cluster=cluster, device=device, backend=backend, timeout_s=timeout_s, owns_group=True
    )


def _create_group(
    cluster: ClusterInfo, *, device: torch.device, backend: str, timeout_s: float
) -> None:
    """The default group, over the store this kind of job provides."""
    timeout = dt.timedelta(seconds=timeout_s)
    device_id = device if device.type == "cuda" else None
    if cluster.world_size == 1:
        # No peers: an in-memory store, no port, nothing to collide with.
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
    elif (attempt := envmod.agent_store_attempt(envmod.current())) is not None:
        # The agent's store outlives a restart, and the ranks of a restarted
        # attempt would read the previous attempt's gloo/NCCL addresses from it
        # (connection refused): give every attempt its own key space.
        store = dist.TCPStore(
            cluster.master_addr, cluster.master_port, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"manygpu/attempt_{attempt}", store),
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=timeout,
            device_id=device_id,
        )
    elif cluster.source in DIRECT_SOURCES:
        # torch's tcp:// handler with the same settings (its key prefix included),
        # but rank 0's store bound to the job's address only.
        bound = job_store(cluster, timeout, multi_tenant=True)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("default_pg", bound),
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=timeout,
            device_id=device_id,
        )
    else:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=timeout,
            device_id=device_id,
        )


def store_host(cluster: ClusterInfo) -> str:
    """The address the job's store listens on and every rank connects to.

    srun or mpirun with every rank on one node: loopback, whatever name
    MASTER_ADDR or the node list gives (nothing off the machine needs the
    store). Several nodes, or a job started by hand: MASTER_ADDR.
    """
    one_node = cluster.local_world_size >= cluster.world_size
    return LOOPBACK if cluster.source in DIRECT_SOURCES and one_node else cluster.master_addr


def job_store(cluster: ClusterInfo, timeout: dt.timedelta, **options: Any) -> dist.TCPStore:
    """Rank 0 hosts the job's store on :func:`store_host` alone; the other ranks join it.

    ``options`` go to every rank's ``TCPStore`` (``wait_for_workers``,
    ``multi_tenant``...); ``timeout`` bounds the connection and every wait.
    """
    host, port = store_host(cluster), cluster.master_port
    if cluster.rank != 0:
        return dist.TCPStore(
            host, port, cluster.world_size, is_master=False, timeout=timeout, **options
        )
    several_nodes = cluster.local_world_size < cluster.world_size
    return dist.TCPStore(
        host,
        port,
        cluster.world_size,
        is_master=True,
        timeout=timeout,
        master_listen_fd=listen_fd(host, port, reachable=several_nodes),
        use_libuv=True,
        **options,
    )


def listen_fd(host: str, port: int, *, reachable: bool = False) -> int:
    """A socket listening on ``host:port`` only (never the wildcard); the store owns the fd.

    Args:
        reachable: other nodes must connect, so a loopback address (a host
            name that ``/etc/hosts`` maps to 127.0.1.1) is refused, in one line.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise UsageError(
            f"rank 0: cannot resolve MASTER_ADDR {host!r} ({why}); give rank 0's node "
            "address or a name every node resolves"
        ) from None
    errors: list[OSError] = []
    for family, kind, proto, _, addr in infos:
        if reachable and ipaddress.ip_address(addr[0]).is_loopback:
            continue
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr[:2] if family == socket.AF_INET else addr)
            sock.listen(socket.SOMAXCONN)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        return sock.detach()
    raise _listen_error(host, port, infos, errors)


def _listen_error(host: str, port: int, infos: list[Any], errors: list[OSError]) -> UsageError:
    """Why rank 0 could not host the store, and what to change, in one line."""
    where = f"rank 0 cannot host the job's store on {host}:{port}"
    if not errors:
        found = ", ".join(sorted({str(info[4][0]) for info in infos}))
        return UsageError(
            f"{where}: {host} is a loopback address here ({found}), which ranks on other "
            "nodes cannot reach; export MASTER_ADDR=<this node's address on the job's network>"
        )
    first = errors[0]
    if first.errno == errno.EADDRINUSE:
        fix = "the port is taken: choose another MASTER_PORT, or stop the process holding it"
    elif first.errno == errno.EADDRNOTAVAIL:
        fix = f"{host} is not an address of this machine: start rank 0 on MASTER_ADDR's node"
    else:
        fix = first.strerror or str(first)
    return UsageError(f"{where}: {fix}")


def teardown(ctx: DistContext) -> None:
    """Destroy the default group if we created it (safe to call twice).

    Gloo's worker threads release a finished collective's tensors a moment after
    ``wait()`` returns, and need the GIL to do it. If the group is destroyed later
    from a deallocation that holds the GIL (DDP's reducer going away), its
    destructor joins those threads while they wait for the GIL: a deadlock seen
    at exit. A short sleep (which releases the GIL) lets them finish first.
    """
    if ctx.owns_group and dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()
