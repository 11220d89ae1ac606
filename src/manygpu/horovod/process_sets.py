"""Horovod's process sets on torch.distributed: named subsets of the job's ranks.

A :class:`ProcessSet` is a sorted list of global ranks. Registered (in
``hvd.init(process_sets=[...])``, or later with :func:`add_process_set` when
sets are dynamic), it gets an id (1, 2, ...; a removed set's id is reused
first, as in Horovod) and a sub-group of the job's process group
(``torch.distributed.new_group``). ``hvd.global_process_set`` (id 0) is the
whole job and needs no sub-group.

``new_group`` is collective over every rank of the job, in the same order on
every rank: that is Horovod's own rule for adding and removing sets ("calls
must be made identically and in the same order by all processes"), so each
add and remove is first checked across ranks, and a rank that adds another
set gets an error naming the ranks instead of a wrong group or a hang.

Every collective resolves its ``process_set=`` through :func:`resolve`, one
function that gives the sub-group, its size, this rank's place in it and the
translation between set ranks and global ranks. As in Horovod, ``root_rank``
stays a global rank, and a rank outside the set that calls an operation on
it gets an error (Horovod: "Rank 1 is not a member of the provided process
set").

This is the first step of a call's path (see the package's docstring): it owns
the registered sets (:class:`SetTable`, in the session) and the ids of
:data:`global_process_set`; a :class:`~manygpu.horovod.basics.Scope` is the plain
value every later step is handed. Adding or removing a set is itself a call,
agreed on through :mod:`manygpu.horovod.checks`, the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.distributed as dist

from manygpu.comm.common import active
from manygpu.errors import UsageError
from manygpu.horovod.basics import Scope, owned, session, whole_job
from manygpu.horovod.checks import agree
from manygpu.horovod.reports import forget_set
from manygpu.runtime import env as envmod


class ProcessSet:
    """Ranks that run collectives together; pass it as ``process_set=`` to an operation.

    Build it from a list of global ranks, then register it with ``hvd.init(process_sets=[...])``
    or ``hvd.add_process_set``; ``process_set_id`` is ``None`` until then (and after removal).
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: None = None
    """Horovod builds sets from MPI communicators too; here only rank lists."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = checked_ranks(ranks)

    def size(self) -> int | None:
        """Processes in the set; ``None`` when it is not registered."""
        if self.process_set_id is None:
            return None
        return resolve(self, "ProcessSet.size", member=False).size

    def rank(self) -> int | None:
        """This process's rank within the set (``None`` when not registered).

        Operations such as ``hvd.broadcast`` still take global ranks (``hvd.rank()``).
        """
        if self.process_set_id is None:
            return None
        scope = resolve(self, "ProcessSet.rank", member=False)
        if scope.rank < 0:
            raise UsageError(f"rank {scope.me} is not part of {self}; check ps.included() first")
        return scope.rank

    def included(self) -> bool | None:
        """Whether this process belongs to the set (``None`` for a set without ranks)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return session().topology.rank in self.ranks

    def __str__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"
        )

    __repr__ = __str__


def checked_ranks(ranks: object) -> list[int]:
    """``ranks`` as a sorted list of distinct non-negative ints, or one clear error."""
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Iterable):
        raise UsageError(
            f"hvd.ProcessSet takes a list of global ranks, not {type(ranks).__name__} "
            "(MPI communicators are not supported: list the ranks)"
        )
    values = list(ranks)
    if not values or any(type(r) is not int or r < 0 for r in values):
        raise UsageError(
            f"hvd.ProcessSet({values!r}): give a non-empty list of global ranks (ints >= 0)"
        )
    if len(set(values)) != len(values):
        raise UsageError(f"hvd.ProcessSet({values!r}): a rank is listed twice")
    return sorted(values)


global_process_set = ProcessSet([0])
"""The whole job (id 0); its ``ranks`` are filled in by ``hvd.init``."""
global_process_set.ranks = []
global_process_set.process_set_id = 0


@dataclass
class SetTable:
    """The session's registered sets (dropped with it at ``hvd.shutdown``); only this
    module changes it."""

    dynamic: bool = False
    """Whether ``add_process_set``/``remove_process_set`` are allowed after ``init``."""
    scopes: dict[int, Scope] = field(default_factory=dict)
    free_ids: deque[int] = field(default_factory=deque)
    next_id: int = 1

    def new_id(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        self.next_id += 1
        return self.next_id - 1


def _table() -> SetTable:
    return owned(SetTable)


def resolve(process_set: object, what: str, *, member: bool = True) -> Scope:
    """The scope of ``process_set`` for operation ``what``; one clear error when unusable.

    Args:
        process_set: a registered :class:`ProcessSet` (``None`` means the whole job).
        what: the operation, as errors name it (``"allreduce"``).
        member: refuse (as Horovod) a rank that is not in the set.
    """
    if process_set is None or process_set is global_process_set:
        return whole_job()
    if not isinstance(process_set, ProcessSet):
        raise UsageError(
            f"{what}: process_set must be a hvd.ProcessSet (hvd.add_process_set(ranks) or "
            f"hvd.init(process_sets=[...])), not {type(process_set).__name__}"
        )
    scope = _table().scopes.get(process_set.process_set_id or 0)
    if scope is None or list(scope.ranks) != process_set.ranks:
        raise UsageError(
            f"{what}: {process_set} is not registered (never added, removed, or from before "
            "hvd.shutdown); register it with hvd.add_process_set or hvd.init(process_sets=[...])"
        )
    if member and scope.rank < 0:
        raise UsageError(
            f"{what}: rank {scope.me} is not a member of the provided process set "
            f"(ranks {list(scope.ranks)}); call it only where process_set.included()"
        )
    return scope


def setup(process_sets: object) -> None:
    """At ``hvd.init`` (:mod:`manygpu.horovod.lifecycle`), once the session exists:
    register the static sets in order, or allow dynamic ones."""
    dynamic = envmod.horovod_dynamic_process_sets(envmod.current())
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise UsageError(
                f"hvd.init(process_sets={process_sets!r}): give a list of hvd.ProcessSet "
                "or 'dynamic'"
            )
        dynamic, process_sets = True, []
    _table().dynamic = dynamic
    global_process_set.ranks = list(range(session().topology.size))
    if process_sets is None:
        process_sets = []
    if not isinstance(process_sets, list | tuple):
        raise UsageError(
            f"hvd.init(process_sets=...) takes a list of hvd.ProcessSet or 'dynamic', "
            f"not {type(process_sets).__name__}"
        )
    for i, ps in enumerate(process_sets):
        if not isinstance(ps, ProcessSet):
            raise UsageError(
                f"hvd.init: process_sets entry {i} is a {type(ps).__name__}, not a hvd.ProcessSet"
            )
        _register(ps, f"hvd.init: process_sets entry {i}")


def _register(ps: ProcessSet, what: str) -> None:
    table = _table()
    ranks = list(ps.ranks or [])
    size = session().topology.size
    if ranks[-1] >= size:
        raise UsageError(
            f"{what}: {ps} names rank {ranks[-1]}, but the job has ranks 0..{size - 1}"
        )
    # Every rank must register the same sets in the same order (new_group is collective).
    agree("barrier", None, key=("add_process_set", ranks), desc=f"add_process_set({ranks})")
    known = [s.ranks for s in table.scopes.values()]
    if ranks == global_process_set.ranks or tuple(ranks) in known:
        raise UsageError(f"{what}: a process set with ranks {ranks} exists already")
    group = dist.new_group(ranks) if active() else None
    set_id = table.new_id()
    table.scopes[set_id] = Scope(
        set_id=set_id, ranks=tuple(ranks), group=group, me=session().topology.rank
    )
    ps.process_set_id = set_id


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a set after ``hvd.init`` (dynamic sets); every rank calls it, in the same order.

    Returns the registered :class:`ProcessSet` (built from ``process_set`` when it is
    a list of ranks).
    """
    table = _table()
    if not table.dynamic:
        raise UsageError(
            "hvd.add_process_set needs dynamic process sets: call "
            "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1"
        )
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    _register(ps, "hvd.add_process_set")
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set (every rank calls it, in the same order); whether it was registered.

    The global set is never removed (``False``), as in Horovod.
    """
    table = _table()
    if not table.dynamic:
        raise UsageError(
            "hvd.remove_process_set needs dynamic process sets: call "
            "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1"
        )
    if not isinstance(process_set, ProcessSet):
        raise UsageError(
            f"hvd.remove_process_set takes a hvd.ProcessSet, not {type(process_set).__name__}"
        )
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    agree("barrier", None, key=("remove_process_set", set_id), desc=f"remove_process_set({set_id})")
    process_set.process_set_id = None
    scope = table.scopes.pop(set_id, None)
    if scope is None:
        return False
    table.free_ids.append(set_id)
    forget_set(set_id)
    if scope.group is not None and scope.rank >= 0:
        dist.destroy_process_group(scope.group)
    return True


def check_process_set(process_set: object) -> None:
    """For an operation that runs on the whole job only: refuse any other set, clearly."""
    if resolve(process_set, "this operation").whole:
        return
    raise UsageError(
        f"this operation runs on every rank of the job only, not on {process_set}; "
        "pass process_set=hvd.global_process_set"
    )
