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
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.job_store import job_store

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
    meshes: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """The job's device meshes, built once each (see ``manygpu.strategies.mesh.job_mesh``)."""

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
    else:
        store = shared_store(cluster, timeout)
        if envmod.agent_store_attempt(envmod.current()) is None:
            # srun / mpirun (torch's tcp:// handler) or a start by hand (env://):
            # torch's key prefix for the default group.
            store = dist.PrefixStore("default_pg", store)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(next_group_prefix(), store),
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=timeout,
            device_id=device_id,
        )


_groups_created = itertools.count()
"""Default groups this process has created (see :func:`next_group_prefix`)."""


_job_stores: dict[tuple[str, int, int, int], dist.Store] = {}
"""Stores this process reached without an agent, kept for its lifetime (see shared_store)."""


def next_group_prefix() -> str:
    """A key space of its own for the next default group this process creates.

    torch names every default group ``0`` (its group counter restarts when the
    default group is destroyed), so a second group on the same store (``hvd.init()``
    after ``hvd.shutdown()``, a second ``Parallel``) would find the previous
    group's gloo addresses under the same keys and connect to sockets that are
    closed or closing: a hang, then "connect timeout" or "connection reset".
    Every rank creates and destroys its default groups in the same order (each
    creation is a collective), so counting them here gives every rank the same
    prefix for the same group without asking the store.
    """
    return f"manygpu/group_{next(_groups_created)}"


def shared_store(
    cluster: ClusterInfo, timeout: dt.timedelta, *, wait_for_workers: bool = True
) -> dist.Store:
    """The job's key-value store, as every rank reaches it; groups are built on it.

    Under torch's agent: the agent's store, in this restart attempt's own key space
    (the store outlives a restart, and a restarted attempt would otherwise read the
    previous attempt's gloo/NCCL addresses: connection refused). Otherwise (srun,
    mpirun, a start by hand): rank 0 hosts it, bound to the job's address only
    (torch binds every address), behind a gate when that is a network one.
    ``wait_for_workers``: rank 0 waits in the constructor until every rank came.

    Rank 0's store is made once per process and kept: were it destroyed with a
    group and hosted again for the next (``hvd.init()`` after ``hvd.shutdown()``),
    a rank quicker to the next group could connect to the old one as it closes.
    """
    attempt = envmod.agent_store_attempt(envmod.current())
    if attempt is not None:
        store = dist.TCPStore(
            cluster.master_addr, cluster.master_port, is_master=False, timeout=timeout
        )
        return dist.PrefixStore(f"manygpu/attempt_{attempt}", store)
    where = (cluster.master_addr, cluster.master_port, cluster.rank, cluster.world_size)
    if where not in _job_stores:
        _job_stores[where] = job_store(
            cluster, timeout, wait_for_workers=wait_for_workers, multi_tenant=True
        )
    return _job_stores[where]


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
    forget_dtensor_specs()  # the job's meshes go with it, whoever owns the default group


def forget_dtensor_specs() -> None:
    """Clear DTensor's cache of sharding results (when DTensor was used at all).

    It is keyed by the ops' input specs, whose meshes compare equal by layout
    and axis names, not by process groups: a later job in this process with an
    equal mesh (``{"dp": 2, "ep": 2}`` then ``{"fsdp": 2, "ep": 2}`` share the
    ``ep`` sub-mesh) would get back output specs holding this job's destroyed
    groups, and its first collective on them would fail.
    """
    if "torch.distributed.tensor._api" not in sys.modules:
        return
    from torch.distributed.tensor import debug

    debug._clear_sharding_prop_cache()  # Python's cache and the C++ fast path's
