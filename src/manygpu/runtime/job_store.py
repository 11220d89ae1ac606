"""The store of a job that no launcher hosts: rank 0 serves it, on the job's address only.

srun or mpirun starting every rank directly (or a start by hand with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``) has no agent to host a store, so rank
0 does. torch's ``tcp://`` and ``env://`` handlers bind it to every address;
here it listens on loopback when every rank is on one node, else on
``MASTER_ADDR`` alone. A store reachable from the network sits behind a gate
keyed by the job's secret (``MANYGPU_JOB_SECRET``, the same on every rank),
and the other ranks reach it through a door on their loopback
(:mod:`manygpu.runtime.store_gate`), as under ``manygpu launch``.
"""

from __future__ import annotations

import datetime as dt
import errno
import ipaddress
import socket
from typing import Any

import torch.distributed as dist

from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime import secret as secretmod
from manygpu.runtime import store_gate
from manygpu.runtime.cluster import ClusterInfo

LOOPBACK = "127.0.0.1"
DIRECT_SOURCES = frozenset({"slurm", "mpi"})
_KEEP: list[object] = []
"""Gates and doors live as long as the process (their threads are daemons)."""


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
    secret = _secret_for(host)
    if cluster.rank != 0:
        if secret is not None:
            host, port = LOOPBACK, _door(secret, host, port, timeout)
        return dist.TCPStore(
            host, port, cluster.world_size, is_master=False, timeout=timeout, **options
        )
    several_nodes = cluster.local_world_size < cluster.world_size
    fd = listen_fd(host, port, reachable=several_nodes)
    if secret is not None:
        # The gate opens first: a store told the world size waits in its
        # constructor for every rank, and they come in through the gate.
        inner = store_gate.listen(LOOPBACK, 0)
        _KEEP.append(store_gate.Gate(secret.gate_key, socket.socket(fileno=fd), _port(inner)))
        host, port, fd = LOOPBACK, _port(inner), inner.detach()
    return dist.TCPStore(
        host,
        port,
        cluster.world_size,
        is_master=True,
        timeout=timeout,
        master_listen_fd=fd,
        use_libuv=True,
        **options,
    )


def _port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def _secret_for(host: str) -> secretmod.JobSecret | None:
    """The job's secret when its store is reachable from the network (required then)."""
    if secretmod.is_loopback(host):
        return None
    secret = secretmod.load(None, envmod.current())
    if secret is None:
        raise UsageError(
            f"this job's store listens on {host}, a network address, so every rank must "
            "prove it belongs to the job: export MANYGPU_JOB_SECRET=$(openssl rand -hex 32) "
            "before srun / mpirun (mpirun: -x MANYGPU_JOB_SECRET), the same for every rank"
        )
    return secret


def _door(secret: secretmod.JobSecret, host: str, port: int, timeout: dt.timedelta) -> int:
    """A door on loopback to rank 0's gate; its port. A wrong secret fails here, in one line."""
    try:
        door = store_gate.open_door(secret.gate_key, host, port, timeout.total_seconds())
    except (store_gate.DoorRefused, ConnectionError) as exc:
        raise UsageError(str(exc)) from None
    return int(door.port)


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
