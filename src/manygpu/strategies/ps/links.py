"""The parameter-server job's process groups: one per role, and one gloo pair per link.

Workers are the training job: their default process group holds the workers
alone, so everything a loop does among workers (``par.reduce``, barriers, the
``Checkpointer``, the data sampler) runs over them with ``par.rank`` and
``par.world_size`` counting workers, and rank 0 of that group (the first
worker) is the main process. Servers get a group of their own (they combine
gradient norms over it when clipping).

Each (server, worker) pair talks over its own two-rank ``ProcessGroupGloo``
(c10d point-to-point ``send`` / ``recv``, built on one ``TCPStore`` with a
prefix per pair): a pair whose worker dies breaks alone, so an asynchronous
server can drop that worker and go on with the others. Every wait has a
timeout and every error names the peer's global rank.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from manygpu.comm.common import first_line
from manygpu.errors import CollectiveTimeoutError, UsageError, peer_lost
from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.process_group import DistContext, shared_store

Role = Literal["server", "worker"]
_TAG = 0


class Link:
    """One (server, worker) pair's gloo group, seen from one side."""

    def __init__(self, group: dist.ProcessGroupGloo, *, me: int, peer: int, peer_name: str) -> None:
        self.group: Any = group  # torch's stubs lack ProcessGroupGloo's send / recv
        self.me = me
        """This process's global rank."""
        self.peer = peer
        """The other side's global rank."""
        self.peer_name = peer_name
        """``"parameter server rank 0"`` or ``"worker rank 3"``: how errors name it."""
        self._other = 1 if peer > me else 0  # the server is the lower global rank: pair rank 0

    def send(self, tensor: torch.Tensor) -> dist.Work:
        """Post a send (a link already broken raises, naming the peer)."""
        try:
            return self.group.send([tensor], self._other, _TAG)
        except RuntimeError as exc:
            raise self._error("sending", None, exc) from exc

    def recv(self, tensor: torch.Tensor) -> dist.Work:
        """Post a receive (a link already broken raises, naming the peer)."""
        try:
            return self.group.recv([tensor], self._other, _TAG)
        except RuntimeError as exc:
            raise self._error("receiving", None, exc) from exc

    def wait(self, work: dist.Work, what: str, timeout_s: float) -> None:
        """Wait for ``work``; a timeout or a lost peer raises, naming the peer."""
        try:
            work.wait(dt.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise self._error(what, timeout_s, exc) from exc

    def _error(self, what: str, timeout_s: float | None, exc: BaseException) -> Exception:
        return CollectiveTimeoutError(
            self.me, f"{what} with {self.peer_name}", timeout_s, short(exc)
        )

    def exchange(
        self,
        sends: list[torch.Tensor],
        recvs: list[torch.Tensor],
        what: str,
        timeout_s: float,
    ) -> None:
        """Post every send and receive, then wait for all (in order)."""
        works = [self.send(t) for t in sends] + [self.recv(t) for t in recvs]
        for work in works:
            self.wait(work, what, timeout_s)


def short(exc: BaseException) -> str:
    """A backend error's gist: gloo's source location and its advice left out."""
    text = first_line(exc)
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0]


def lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the peer went away (rather than stayed silent)."""
    return peer_lost(str(exc)) or "connection closed" in str(exc).lower()


@dataclass(frozen=True, kw_only=True)
class PSContext(DistContext):
    """A :class:`DistContext` whose ``cluster`` is this role's view, plus the links."""

    role: Role
    global_cluster: ClusterInfo
    """The whole job as launched (servers first)."""
    servers: int
    workers: int
    links: dict[int, Link] = field(default_factory=dict)
    """Peer global rank -> link: every worker for a server, every server for a worker."""

    @property
    def index(self) -> int:
        """This process's index among its role (server s, or worker w)."""
        return self.cluster.rank


def role_view(cluster: ClusterInfo, servers: int) -> tuple[Role, ClusterInfo]:
    """This process's role and its job as that role sees it (its rank among its role)."""
    if cluster.rank < servers:
        return "server", replace(cluster, rank=cluster.rank, world_size=servers)
    return "worker", replace(
        cluster, rank=cluster.rank - servers, world_size=cluster.world_size - servers
    )


def join(
    cluster: ClusterInfo,
    servers: int,
    *,
    device: torch.device,
    backend: str,
    timeout_s: float,
) -> PSContext:
    """Create this role's default group and this process's links (every rank calls it)."""
    if dist.is_initialized():
        raise UsageError(
            "strategy 'ps' creates its own process groups (servers and workers apart): "
            "create Parallel before any init_process_group, or use another strategy"
        )
    timeout = dt.timedelta(seconds=timeout_s)
    role, view = role_view(cluster, servers)
    # The job's store, as the default group's bootstrap reaches it (runtime's).
    store = shared_store(cluster, timeout, wait_for_workers=False)
    # Servers compute on the CPU (gloo carries the links), workers on their device.
    group_backend = backend if role == "worker" else "gloo"
    dist.init_process_group(
        group_backend,
        store=dist.PrefixStore(f"manygpu/ps-{role}", store),
        rank=view.rank,
        world_size=view.world_size,
        timeout=timeout,
        device_id=device if role == "worker" and device.type == "cuda" else None,
    )
    links = _links(cluster, servers, store, timeout)
    return PSContext(
        cluster=view,
        device=device if role == "worker" else torch.device("cpu"),
        backend=group_backend,
        timeout_s=timeout_s,
        owns_group=True,
        role=role,
        global_cluster=cluster,
        servers=servers,
        workers=cluster.world_size - servers,
        links=links,
    )


def _links(
    cluster: ClusterInfo, servers: int, store: dist.Store, timeout: dt.timedelta
) -> dict[int, Link]:
    """This process's pair groups, built in (server, worker) order on every rank.

    A pair's constructor waits for its other side; the same global order on
    every rank means no two ranks ever wait on each other crosswise.
    """
    me = cluster.rank
    out: dict[int, Link] = {}
    for s in range(servers):
        for w in range(servers, cluster.world_size):
            if me not in (s, w):
                continue
            prefix = dist.PrefixStore(f"manygpu/ps-link/{s}/{w}", store)
            group = dist.ProcessGroupGloo(prefix, 0 if me == s else 1, 2, timeout)
            peer = w if me == s else s
            name = f"worker rank {w}" if me == s else f"parameter server rank {s}"
            out[peer] = Link(group, me=me, peer=peer, peer_name=name)
    return out
