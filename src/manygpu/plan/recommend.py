"""Pick a strategy: the fastest predicted one whose memory fits, simplest on a near-tie.

When no speed can be estimated (no FLOPs or measured step), the pick is the
simplest that fits, and nothing is called the fastest.

``recommend`` is what ``strategy="auto"`` calls. It returns a registered
strategy name (the candidates and their costs come from the registry's cards) and
the sizes (data-parallel, pipeline or tensor ways) with every candidate's
numbers, so the choice can be shown and checked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from manygpu.errors import UsageError
from manygpu.plan import memory, perf, recompute
from manygpu.plan.desc import ModelDesc
from manygpu.plan.devices import resolve_precision
from manygpu.plan.hardware import Cluster
from manygpu.plan.recipe import Recipe
from manygpu.strategies.axes import axis
from manygpu.strategies.registry import StrategyCard, card, cards

NEAR_TIE = 0.02
"""Candidates within 2% of the best throughput count as equally fast."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One strategy's predicted memory and speed."""

    strategy: str
    ways: int
    """Pipeline / tensor / model ways (1 for data parallelism)."""
    memory: memory.MemoryEstimate
    step: perf.StepEstimate | None
    """``None`` when the step cannot be modelled (e.g. tensor without a shape)."""
    fits: bool
    recipe: Recipe
    """Its sizes and the ``Parallel(...)`` line whose memory was counted."""
    activations_saved: float = 0.0
    """Bytes of activations the recipe's checkpointing saves per device (0: none)."""
    extra_compute: float = 0.0
    """The recomputation it costs, as a fraction of the compute (0.3: 30% more)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The recommendation; ``strategy`` is a registry name for :class:`~manygpu.Parallel`."""

    strategy: str
    world_size: int
    precision: str
    """The precision the step was timed at (``auto`` resolved for the device)."""
    data_parallel: int
    pipeline_parallel: int
    tensor_parallel: int
    memory_per_device_gb: float
    step_s: float | None
    """``None`` (as efficiency and samples/s) when the speed cannot be estimated."""
    efficiency: float | None
    samples_per_s: float | None
    reason: str
    layout: str
    """The sizes in words (``dp 8``, ``dp 4 x tp 2``), as the candidates' table shows them."""
    parallel_line: str
    """The ``Parallel(...)`` call that runs what was counted."""
    candidates: tuple[Candidate, ...]


def _has_tf32(cluster: Cluster) -> bool:
    """Whether ``precision="fp32"`` would run TF32 matmuls there: a known device with a
    TF32 peak, or an unknown one (the strict spelling is then the safe one)."""
    return cluster.device is None or "tf32" in cluster.device.peak_tflops


def _candidates(
    desc: ModelDesc,
    cluster: Cluster,
    world: int,
    batch: int,
    precision: str,
    optimizer: str,
    mfu: float | None,
) -> list[Candidate]:
    options = [
        (c.name, ways)
        for c in cards()
        if c.plan_ways != "never" and c.one_process == (world == 1)
        for ways in _ways(c, world, cluster.gpus_per_node)
        if _applies(c, desc, ways)
    ]
    out = []
    for strategy, ways in options:
        mem, mode, plain = _fitting_memory(desc, strategy, world, ways, batch, precision,
                                           optimizer, cluster.memory_gb)  # fmt: skip
        recipe = Recipe(strategy=strategy, world=world, ways=ways, precision=precision,
                        checkpointing=mode, tf32=_has_tf32(cluster))  # fmt: skip
        try:
            step = perf.estimate(desc, cluster, strategy, batch=batch, precision=precision,
                                 world=ways if card(strategy).one_process else world, stages=ways,
                                 mfu=mfu, grad_bytes=recipe.grad_bytes)  # fmt: skip
        except UsageError:
            step = None
        extra = recompute.cost(desc, mode).extra_compute if mode is not None else 0.0
        if step is not None and extra:  # recomputation is compute, on every device
            more = 1 + extra
            step = replace(step, compute_s=step.compute_s * more, ideal_s=step.ideal_s * more)
        out.append(Candidate(strategy=strategy, ways=ways, memory=mem, step=step,
                             fits=mem.fits(cluster.memory_gb), recipe=recipe,
                             activations_saved=plain.activations - mem.activations,
                             extra_compute=extra))  # fmt: skip
    return out


def _fitting_memory(
    desc: ModelDesc, strategy: str, world: int, ways: int, batch: int, precision: str,
    optimizer: str, memory_gb: float,
) -> tuple[memory.MemoryEstimate, str | None, memory.MemoryEstimate]:  # fmt: skip
    """The candidate's memory, the activation checkpointing it needs to fit (none, else
    ``"selective"``: no extra FLOPs, else ``"full"``; none when nothing fits), and its
    memory without checkpointing."""

    def count(mode: str | None) -> memory.MemoryEstimate:
        return _count(desc, strategy, world, ways, batch, precision, optimizer, mode)

    plain = count(None)
    if plain.fits(memory_gb) or not recompute.knows_blocks(desc):
        return plain, None, plain
    for mode in recompute.MODES:
        mem = count(mode)
        if mem.fits(memory_gb):
            return mem, mode, plain
    return plain, None, plain


def _count(
    desc: ModelDesc, strategy: str, world: int, ways: int, batch: int, precision: str,
    optimizer: str, mode: str | None,
) -> memory.MemoryEstimate:  # fmt: skip
    """One candidate's memory per device with activation checkpointing ``mode``."""
    return memory.estimate(desc, strategy, world=world, batch=batch, precision=precision,
                           optimizer=optimizer, stages=ways,
                           microbatches=min(4 * ways, ways * batch),
                           checkpointing=mode)  # fmt: skip


def _fits_none(
    desc: ModelDesc, cands: list[Candidate], world: int, memory_gb: float, batch: int,
    precision: str, optimizer: str,
) -> str:  # fmt: skip
    """Why nothing fits, in one line: the smallest candidate's need and, where the
    model's blocks are known, that even ``"full"`` checkpointing (the least a block
    can keep) does not help, so the user looks for the fix elsewhere."""
    head = (
        f"{desc.name} ({desc.parameters / 1e6:,.1f}M parameters) fits no strategy on "
        f"{world} device(s) of {memory_gb:g} GB"
    )
    best = min(cands, key=lambda c: c.memory.total)
    need = f"{best.memory.total / 1e9:,.1f} GB per device"
    if recompute.knows_blocks(desc):
        full = {
            id(c): _count(desc, c.strategy, world, c.ways, batch, precision, optimizer, "full")
            for c in cands
        }
        best = min(cands, key=lambda c: full[id(c)].total)
        head += ', even with activation_checkpointing="full"'
        need = (
            f"{full[id(best)].total / 1e9:,.1f} GB per device with it "
            f"({best.memory.total / 1e9:,.1f} GB without)"
        )
    where = f"{best.strategy}{f' x{best.ways}' if best.ways > 1 else ''}"
    return f"{head}: the smallest, {where}, needs {need}; lower the batch or add devices"


def _applies(entry: StrategyCard, desc: ModelDesc, ways: int) -> bool:
    """Whether the model has what the strategy splits: a strategy that splits experts
    (expert parallelism) needs a mixture of experts whose experts divide by its ways."""
    if entry.memory.experts is None:
        return True
    return desc.expert_parameters > 0 and desc.num_experts % ways == 0


def _ways(entry: StrategyCard, world: int, gpus_per_node: int) -> list[int]:
    """The model-split sizes the planner tries for one strategy (see ``plan_ways``):
    on a mesh axis, the world's divisors, within a node where the axis stays in one."""
    splits = [w for w in (2, 4, 8, 16, 32, 64) if w <= world and world % w == 0]
    ways_axis = entry.plan_axis()
    in_node = ways_axis is not None and axis(ways_axis).in_node
    return {
        "one": [1],
        "local_devices": list(range(2, gpus_per_node + 1)),
        "axis": [w for w in splits if w <= gpus_per_node or not in_node],
        "servers": [k for k in (1, 2, 4, 8, 16, 32) if k <= world // 2],
        "never": [],
    }[entry.plan_ways]


def recommend(
    model: nn.Module | ModelDesc,
    cluster: Cluster,
    *,
    batch: int = 32,
    precision: str = "fp32",
    optimizer: str = "adam",
    world_size: int | None = None,
    mfu: float | None = None,
) -> Plan:
    """The strategy and sizes to run ``model`` with ``batch`` samples per device per step.

    A bare ``nn.Module`` is described by its parameters only (no FLOPs or
    activations are run), which is enough to choose by memory; pass a
    :class:`ModelDesc` (e.g. from :func:`manygpu.plan.desc.describe`) for speed.
    ``precision``: fp32, tf32, bf16, fp16 or auto (bf16 where the device has
    it, else fp16, else fp32); ``mfu``: assume this fraction of the peak
    instead of the device's achievable rates.
    """
    desc = model if isinstance(model, ModelDesc) else _bare(model)
    precision = resolve_precision(precision, cluster.device)
    world = cluster.world_size if world_size is None else world_size
    if world < 1:
        raise UsageError(f"world size must be >= 1, got {world}")
    cands = _candidates(desc, cluster, world, batch, precision, optimizer, mfu)
    fitting = [c for c in cands if c.fits]
    if not fitting:
        raise UsageError(
            _fits_none(desc, cands, world, cluster.memory_gb, batch, precision, optimizer)
        )
    return _plan(_choose(fitting), cands, world, precision, cluster.memory_gb)


def _plan(
    chosen: Candidate, cands: list[Candidate], world: int, precision: str, memory_gb: float
) -> Plan:
    step, recipe = chosen.step, chosen.recipe
    simplest = min(cands, key=_simplicity).strategy
    if step is None:  # memory is all that is known: no candidate is called fastest
        why = "the simplest that fits"
    else:
        why = "fits in memory" if chosen.strategy == simplest else "the fastest that fits"
    return Plan(
        strategy=chosen.strategy,
        world_size=world,
        precision=precision,
        data_parallel=recipe.data_parallel,
        pipeline_parallel=recipe.pipeline_parallel,
        tensor_parallel=recipe.tensor_parallel,
        memory_per_device_gb=chosen.memory.total / 1e9,
        step_s=step.step_s if step else None,
        efficiency=step.efficiency if step else None,
        samples_per_s=step.samples_per_s if step else None,
        reason=f"{chosen.strategy}: {why} ({chosen.memory.total / 1e9:,.2f} GB per device "
        f"of {memory_gb:,.1f})",
        layout=recipe.layout(),
        parallel_line=recipe.parallel_line(),
        candidates=tuple(cands),
    )


def _choose(fitting: list[Candidate]) -> Candidate:
    timed = [c for c in fitting if c.step is not None]
    if not timed:  # nothing could be timed (no FLOPs known): choose by simplicity
        return min(fitting, key=_simplicity)
    best = max(c.step.samples_per_s for c in timed if c.step)
    near = [c for c in timed if c.step and c.step.samples_per_s >= best * (1 - NEAR_TIE)]
    return min(near, key=_simplicity)


def _simplicity(c: Candidate) -> tuple[int, int]:
    """Tie-break order: fewer moving parts first (the cards' ranks), then fewer ways."""
    return card(c.strategy).simplicity, c.ways


def _bare(model: nn.Module) -> ModelDesc:
    """Parameters and the largest module only: enough to choose by memory."""
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    return ModelDesc(
        name=type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        largest_layer_parameters=max(own, default=0),
    )
