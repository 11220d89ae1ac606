"""Parallelism as data: sizes per named mesh dimension, validated, then a ``DeviceMesh``.

Plain data (torch's mesh is built on demand); the FSDP2 calls that use a
mesh live in :mod:`.sharded`.

A job's ranks form a grid with up to four named dimensions, outermost first:

- ``pp``: pipeline stages (one stage per coordinate),
- ``dp``: data-parallel replicas (gradients all-reduced; HSDP's "replicate"),
- ``fsdp``: data-parallel shards (parameters sharded, FSDP's "shard"),
- ``tp``: tensor-parallel shards of each layer (innermost: the chattiest, so
  its ranks are neighbours, i.e. on the same node).

``-1`` in one dimension means "whatever the world size leaves". Ranks are laid
out row-major, so rank = ((pp_i * dp + dp_i) * fsdp + fsdp_i) * tp + tp_i.
Every rank with the same (dp_i, fsdp_i) reads the same data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from manygpu.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from manygpu.runtime.process_group import DistContext

MESH_DIMS: tuple[str, ...] = ("pp", "dp", "fsdp", "tp")
DATA_DIMS: tuple[str, ...] = ("dp", "fsdp")


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """Sizes of the named dimensions; ``-1`` in at most one is inferred."""

    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas (all-reduce gradients; across nodes for HSDP)."""
    fsdp: int = 1
    """Data-parallel shards (parameters, gradients and optimizer state sharded)."""
    tp: int = 1
    """Tensor-parallel shards of each layer (keep within a node)."""

    def __post_init__(self) -> None:
        sizes = self.sizes()
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise UsageError(f"mesh size {name}={size!r} must be a positive integer or -1")
        inferred = [name for name, size in sizes.items() if size == -1]
        if len(inferred) > 1:
            raise UsageError(
                f"mesh sizes {', '.join(f'{n}=-1' for n in inferred)}: only one "
                "dimension can be inferred from the world size"
            )

    @classmethod
    def parse(cls, value: MeshSpec | Mapping[str, int]) -> MeshSpec:
        """A spec from a mapping like ``{"dp": 2, "tp": -1}``; unknown names are refused."""
        if isinstance(value, MeshSpec):
            return value
        if not isinstance(value, Mapping):
            raise UsageError(f"mesh must be a mapping like {{'dp': 2, 'tp': 2}}, not {value!r}")
        unknown = sorted(set(value) - set(MESH_DIMS))
        if unknown:
            raise UsageError(
                f"unknown mesh dimension(s) {', '.join(map(repr, unknown))}; "
                f"choose from {', '.join(MESH_DIMS)}"
            )
        return cls(**dict(value))

    def sizes(self) -> dict[str, int]:
        """Name -> size, outermost first."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def resolve(self, world_size: int) -> MeshSpec:
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
            return replace(self, **{name: world_size // known})
        if known != world_size:
            raise UsageError(
                f"mesh {shown or '1'} = {known} != WORLD_SIZE({world_size}); "
                "make the sizes multiply to the number of processes, or set one to -1"
            )
        return self

    @property
    def data_size(self) -> int:
        """How many different data shards a step reads (dp * fsdp)."""
        return self.dp * self.fsdp

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate in each dimension (row-major layout)."""
        out: dict[str, int] = {}
        for name, size in reversed(list(self.sizes().items())):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in MESH_DIMS}

    def data_rank(self, rank: int) -> int:
        """Index of the data shard ``rank`` reads: ranks differing only in pp/tp share it."""
        c = self.coords(rank)
        return c["dp"] * self.fsdp + c["fsdp"]

    def build(self, device_type: str, names: tuple[str, ...] = MESH_DIMS) -> DeviceMesh:
        """A ``DeviceMesh`` over ``names`` (the other dimensions must be 1)."""
        sizes = self.sizes()
        extra = [f"{n}({sizes[n]})" for n in MESH_DIMS if n not in names and sizes[n] != 1]
        if extra:
            raise UsageError(f"this strategy has no use for mesh dimension(s) {', '.join(extra)}")
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names)
        )


def data_dims(spec: MeshSpec) -> tuple[str, ...]:
    """The data dimensions FSDP2 spans: none, ``("fsdp",)``, or both (HSDP).

    ``dp`` alone becomes (dp, fsdp=1): HSDP with shards of one rank, i.e.
    replication with all-reduced gradients, the way DDP would do it.
    """
    if spec.dp > 1:
        return DATA_DIMS
    return ("fsdp",) if spec.fsdp > 1 else ()


def composed_dims(spec: MeshSpec, own: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh dimensions a strategy whose own dimensions are ``own`` composes, outermost
    first: ``pp`` and ``tp`` when it owns them, the data dimensions in between (at least
    ``fsdp`` for a strategy that owns nothing else)."""
    outer = ("pp",) if "pp" in own else ()
    inner = ("tp",) if "tp" in own else ()
    data = data_dims(spec) or (() if outer or inner else ("fsdp",))
    return (*outer, *data, *inner)


def job_mesh(ctx: DistContext, spec: MeshSpec, names: tuple[str, ...]) -> DeviceMesh:
    """The job's ``DeviceMesh`` over ``names``: built once per job, on first use.

    Every strategy and the user's ``par.mesh`` get the same object, so its
    process groups are created once and its named sub-meshes
    (``mesh["tp"]``, ``mesh[("dp", "fsdp")]``) are torch's cached slices.
    """
    key = (spec, names)
    if key not in ctx.meshes:
        ctx.meshes[key] = spec.build(ctx.device.type, names)
    mesh: DeviceMesh = ctx.meshes[key]
    return mesh


def check_dims(strategy: str, spec: MeshSpec, allowed: tuple[str, ...]) -> None:
    """Refuse mesh dimensions a strategy cannot use, naming them and the ones it can."""
    extra = [f"{n}={s}" for n, s in spec.sizes().items() if n not in allowed and s != 1]
    if extra:
        raise UsageError(
            f"strategy {strategy!r} cannot use mesh dimension(s) {', '.join(extra)}; "
            f"it takes {', '.join(allowed)}"
        )


def strategy_for_mesh(spec: MeshSpec) -> str:
    """The strategy that composes the dimensions a mesh asks for (``strategy="hybrid"``)."""
    sizes = spec.sizes()
    if sizes["pp"] != 1:
        return "pipeline"
    if sizes["tp"] != 1:
        return "tensor"
    if sizes["fsdp"] != 1:
        return "fsdp"
    return "ddp"
