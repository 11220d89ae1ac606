"""The mesh's axes as data: one table entry per named axis, everything else derived.

A job's ranks form a grid whose named axes are listed here, outermost first:

- ``pp``: pipeline stages (one stage per coordinate),
- ``dp``: data-parallel replicas (gradients all-reduced; HSDP's "replicate"),
- ``fsdp``: data-parallel shards (parameters sharded, FSDP's "shard"),
- ``ep``: expert shards (each rank holds ``num_experts / ep`` experts; its ranks
  also read different data, "dp2ep": the degree is borrowed from the data),
- ``tp``: tensor-parallel shards of each layer (innermost: the chattiest, so
  its ranks are neighbours, i.e. on the same node).

The mesh's sizes and their refusals, rank coordinates, the data rank, the
axes a strategy composes, what ``strategy="hybrid"`` picks and the sizes the
planner tries are all read from this table (:mod:`.mesh`, :mod:`.registry`,
:mod:`manygpu.plan`), so a new axis (context or expert parallelism) is one
:func:`add_axis` call plus a strategy whose card names it; no other code
lists the axes. Orders leave gaps so an axis can slot between two others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from manygpu.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class MeshAxis:
    """One named axis of the job's mesh."""

    name: str
    """How ``mesh={...}``, ``par.mesh[...]`` and the errors name it (``"tp"``)."""
    order: int
    """Its place in the mesh, outermost (smallest) first; ranks are row-major in it."""
    splits_data: bool
    """Ranks that differ on it read different data (dp, fsdp); ranks that differ
    only on the others (pp, tp) hold parts of one replica and read the same."""
    in_node: bool
    """Its ranks should be neighbours on one node (tp: a collective per layer);
    the planner tries only sizes that fit in a node."""
    doc: str = ""
    """One line for a reader: what a coordinate on this axis holds."""


_TABLE: list[MeshAxis] = [
    MeshAxis(name="pp", order=10, splits_data=False, in_node=False, doc="pipeline stages"),
    MeshAxis(name="dp", order=20, splits_data=True, in_node=False, doc="data replicas"),
    MeshAxis(name="fsdp", order=30, splits_data=True, in_node=False, doc="data shards"),
    # Inside fsdp (torchtitan's ep is the inner part of dp_shard): its all-to-alls, one
    # pair per MoE layer and direction, go between neighbouring ranks.
    MeshAxis(name="ep", order=33, splits_data=True, in_node=True, doc="expert shards"),
    MeshAxis(name="tp", order=40, splits_data=False, in_node=True, doc="layer shards"),
]
"""Every axis, outermost first (kept sorted by :func:`add_axis`)."""


def add_axis(axis: MeshAxis) -> None:
    """Add a mesh axis (a strategy package's own, e.g. context parallelism).

    Its name must be new and its order free: two axes in one place would make
    the rank layout ambiguous.
    """
    for known in _TABLE:
        if known.name == axis.name:
            if known == axis:
                return
            raise ValueError(f"mesh axis {axis.name!r} is added twice: {known} and {axis}")
        if known.order == axis.order:
            raise ValueError(f"mesh axes {known.name!r} and {axis.name!r} share order {axis.order}")
    _TABLE.append(axis)
    _TABLE.sort(key=lambda a: a.order)


def axes() -> tuple[MeshAxis, ...]:
    """Every axis, outermost first."""
    return tuple(_TABLE)


def axis_names() -> tuple[str, ...]:
    """Every axis's name, outermost first."""
    return tuple(a.name for a in _TABLE)


def axis(name: str) -> MeshAxis:
    """The axis called ``name``; a one-line error naming the known ones otherwise."""
    for a in _TABLE:
        if a.name == name:
            return a
    raise UsageError(unknown_axes([name]))


def is_axis(name: str) -> bool:
    """Whether ``name`` is a mesh axis (a card's ``ways_option`` may be an option instead)."""
    return name in axis_names()


def unknown_axes(names: list[str]) -> str:
    """The refusal of names that are no axis, listing the axes there are."""
    return (
        f"unknown mesh dimension(s) {', '.join(map(repr, sorted(names)))}; "
        f"choose from {', '.join(axis_names())}"
    )


def data_axes() -> tuple[str, ...]:
    """The axes that split data, outermost first (``dp``, ``fsdp``)."""
    return tuple(a.name for a in _TABLE if a.splits_data)


def replica_axis() -> str:
    """The outermost data axis: plain replicas (``dp``), where a replicating strategy's
    ranks and the planner's data-parallel count go."""
    return data_axes()[0]


def deciding_axis(sizes: Mapping[str, int]) -> str:
    """The axis whose strategy composes a mesh of ``sizes`` (``strategy="hybrid"``).

    An axis that splits the model decides first (the outermost: it wraps the
    others); without one, the innermost sized data axis (sharding over
    replication); with none sized, the replica axis.
    """
    sized = [a for a in _TABLE if sizes.get(a.name, 1) != 1]
    model = [a.name for a in sized if not a.splits_data]
    data = [a.name for a in sized if a.splits_data]
    if model:
        return model[0]
    return data[-1] if data else replica_axis()
