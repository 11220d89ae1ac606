"""The mesh's shape as data: a size per named axis, validated, then a ``DeviceMesh``.

Plain data (torch's mesh is built on demand); the axes themselves, their order
and what each means, are the table in :mod:`.axes`, and everything here is
derived from it. The FSDP2 calls that use a mesh live in :mod:`.fsdp.sharding`.

``-1`` on one axis means "whatever the world size leaves". Ranks are laid out
row-major in the table's order, so with the built-in axes
rank = ((pp_i * dp + dp_i) * fsdp + fsdp_i) * tp + tp_i. Every rank with the
same coordinates on the data axes (dp_i, fsdp_i) reads the same data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from manygpu.errors import UsageError
from manygpu.strategies.axes import axis, axis_names, data_axes, unknown_axes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from manygpu.runtime.process_group import DistContext


@dataclass(frozen=True, init=False)
class MeshShape:
    """Sizes of the mesh's axes (``MeshShape(dp=2, tp=-1)``); an axis not given is 1,
    ``-1`` on at most one is inferred. Hashable: the job's meshes are cached by it."""

    given: tuple[tuple[str, int], ...]
    """``(axis, size)`` for every axis whose size is not 1, in the table's order."""

    def __init__(self, **sizes: int) -> None:
        unknown = [n for n in sizes if n not in axis_names()]
        if unknown:
            raise UsageError(unknown_axes(unknown))
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise UsageError(f"mesh size {name}={size!r} must be a positive integer or -1")
        inferred = [n for n in axis_names() if sizes.get(n) == -1]
        if len(inferred) > 1:
            raise UsageError(
                f"mesh sizes {', '.join(f'{n}=-1' for n in inferred)}: only one "
                "dimension can be inferred from the world size"
            )
        given = tuple((n, sizes[n]) for n in axis_names() if sizes.get(n, 1) != 1)
        object.__setattr__(self, "given", given)

    def __getattr__(self, name: str) -> int:
        """An axis's size by name (``shape.tp``), 1 where it was not given."""
        if name.startswith("_") or name == "given" or name not in axis_names():
            raise AttributeError(name)
        return dict(self.given).get(name, 1)

    def __repr__(self) -> str:
        return f"MeshShape({', '.join(f'{n}={s}' for n, s in self.sizes().items())})"

    @classmethod
    def parse(cls, value: MeshShape | Mapping[str, int]) -> MeshShape:
        """A shape from a mapping like ``{"dp": 2, "tp": -1}``; unknown names are refused."""
        if isinstance(value, MeshShape):
            return value
        if not isinstance(value, Mapping):
            raise UsageError(f"mesh must be a mapping like {{'dp': 2, 'tp': 2}}, not {value!r}")
        return cls(**dict(value))

    def sizes(self) -> dict[str, int]:
        """Name -> size for every axis, outermost first."""
        given = dict(self.given)
        return {n: given.get(n, 1) for n in axis_names()}

    def sized(self) -> tuple[str, ...]:
        """The axes whose size is not 1 (``-1`` included), outermost first."""
        return tuple(n for n, _ in self.given)

    def resolve(self, world_size: int) -> MeshShape:
        """Fill in ``-1`` and check the product is the world size, naming every factor."""
        sizes = self.sizes()
        known = math.prod(s for s in sizes.values() if s != -1)
        shown = " * ".join(f"{n}({s})" for n, s in sizes.items() if s != 1)
        if -1 in sizes.values():
            name = next(n for n, s in sizes.items() if s == -1)
            if world_size % known:
                others = " * ".join(f"{n}({s})" for n, s in sizes.items() if s not in (1, -1))
                raise UsageError(
                    f"cannot infer mesh size {name}=-1: {others or '1'} = {known} does not "
                    f"divide WORLD_SIZE({world_size}); change the sizes or the process count"
                )
            return MeshShape(**{**sizes, name: world_size // known})
        if known != world_size:
            raise UsageError(
                f"mesh {shown or '1'} = {known} != WORLD_SIZE({world_size}); "
                "make the sizes multiply to the number of processes, or set one to -1"
            )
        return self

    @property
    def data_size(self) -> int:
        """How many different data shards a step reads (the data axes' product: dp * fsdp)."""
        sizes = self.sizes()
        return math.prod(sizes[n] for n in data_axes())

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each axis (row-major layout), outermost first."""
        out: dict[str, int] = {}
        for name, size in reversed(list(self.sizes().items())):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in axis_names()}

    def data_rank(self, rank: int) -> int:
        """Index of the data shard ``rank`` reads: ranks differing only on axes that
        split no data (pp, tp) share it."""
        coords, sizes = self.coords(rank), self.sizes()
        index = 0
        for name in data_axes():
            index = index * sizes[name] + coords[name]
        return index

    def build(self, device_type: str, names: tuple[str, ...]) -> DeviceMesh:
        """A ``DeviceMesh`` over ``names`` (the other axes must be 1)."""
        sizes = self.sizes()
        extra = [f"{n}({s})" for n, s in sizes.items() if n not in names and s != 1]
        if extra:
            raise UsageError(f"this strategy has no use for mesh dimension(s) {', '.join(extra)}")
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names)
        )


def composed_axes(shape: MeshShape, usable: tuple[str, ...], default: str) -> tuple[str, ...]:
    """The axes a strategy composes over a resolved ``shape``, outermost first.

    ``usable``: the axes its card names; ``default``: the one that takes the world
    when no mesh is given. Axes that split the model are composed when sized (or
    the default, even at size 1); the data axes from the outermost sized one
    inward, so replicas alone are HSDP with shards of one rank (FSDP2's 2-D mesh
    wants the shard axis innermost). Nothing sized: the default alone.
    """
    sizes = shape.sizes()
    data = [n for n in usable if axis(n).splits_data]
    sized = [n for n in data if sizes[n] != 1]
    chosen = set(data[data.index(sized[0]) :] if sized else ())
    chosen |= {n for n in usable if not axis(n).splits_data and (sizes[n] != 1 or n == default)}
    return tuple(n for n in axis_names() if n in (chosen or {default}))


def job_mesh(ctx: DistContext, shape: MeshShape, names: tuple[str, ...]) -> DeviceMesh:
    """The job's ``DeviceMesh`` over ``names``: built once per job, on first use.

    Every strategy and the user's ``par.mesh`` get the same object, so its
    process groups are created once and its named sub-meshes
    (``mesh["tp"]``, ``mesh[("dp", "fsdp")]``) are torch's cached slices.
    """
    key = (shape, names)
    if key not in ctx.meshes:
        ctx.meshes[key] = shape.build(ctx.device.type, names)
    mesh: DeviceMesh = ctx.meshes[key]
    return mesh


def check_axes(strategy: str, shape: MeshShape, allowed: tuple[str, ...]) -> None:
    """Refuse mesh axes a strategy cannot use, naming them and the ones it can."""
    extra = [f"{n}={s}" for n, s in shape.sizes().items() if n not in allowed and s != 1]
    if extra:
        raise UsageError(
            f"strategy {strategy!r} cannot use mesh dimension(s) {', '.join(extra)}; "
            f"it takes {', '.join(allowed)}"
        )
