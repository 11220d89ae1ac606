"""Per-strategy knobs, as frozen dataclasses that validate themselves."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch.nn import Module

from manygpu.errors import UsageError

GradCompression = Literal["none", "fp16", "bf16"]


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """Knobs of ``DistributedDataParallel`` worth exposing."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size: bigger buckets, fewer all-reduces, later overlap."""
    find_unused_parameters: bool = False
    """Needed when some parameters get no gradient in a step; costs a graph walk."""
    static_graph: bool = False
    """Promise the graph is the same every step; lets DDP skip work."""
    grad_compression: GradCompression = "none"
    """Compress gradients to fp16/bf16 for the all-reduce (comm hook)."""
    sync_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm stats) to all ranks each forward."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the buckets: saves one copy and memory."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to ``SyncBatchNorm``: statistics over the global
    batch instead of each rank's own (CUDA only: torch has no CPU kernel)."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise UsageError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.grad_compression not in ("none", "fp16", "bf16"):
            raise UsageError(
                f"unknown grad_compression {self.grad_compression!r}; choose none, fp16 or bf16"
            )


ShardDtype = Literal["fp32", "bf16", "fp16"] | None


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """Knobs of ``"fsdp"`` / ``"zero2"`` (FSDP2 ``fully_shard``)."""

    param_dtype: ShardDtype = None
    """Compute dtype of the gathered parameters (mixed precision); ``None`` keeps them."""
    reduce_dtype: ShardDtype = None
    """Dtype of the gradient reduce-scatter; ``None`` = the parameters' dtype."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""
    shard_children: bool = True
    """Shard each block as its own unit (overlap and lower peak memory): the
    members of layer containers (``nn.ModuleList`` of transformer blocks), or
    the direct children of a model without one; tied weights stay in one unit.
    ``False`` makes the whole model one unit."""
    block_classes: tuple[type | str, ...] | type | str = ()
    """The block class(es) to shard as units instead, by class or class name,
    e.g. ``"LlamaDecoderLayer"`` (outermost matches; the root takes the rest)."""

    def __post_init__(self) -> None:
        if isinstance(self.block_classes, (str, type)):
            object.__setattr__(self, "block_classes", (self.block_classes,))
        for cls in self.block_classes:  # type: ignore[union-attr]
            if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, Module)):
                raise UsageError(
                    f"block_classes takes nn.Module classes or class names, not {cls!r}"
                )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in (None, "fp32", "bf16", "fp16"):
                raise UsageError(f"unknown {name} {value!r}; choose fp32, bf16 or fp16")


PipelineSchedule = Literal["gpipe", "1f1b"]
Balance = Literal["params", "time"]


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """Knobs of ``"pipeline"`` (``torch.distributed.pipelining``)."""

    loss_fn: Callable[[Any, Any], Any] | None = None
    """``loss_fn(output, target)`` run on the last stage per micro-batch
    (mean-reduced losses give the same gradients as one big batch). Required
    for training: ``loss = model(x, target=y)`` runs forward and backward."""
    microbatches: int = 4
    """Micro-batches per batch; the batch size must be a multiple of it."""
    schedule: PipelineSchedule = "1f1b"
    """``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"`` (interleaved:
    activation memory bounded by the stage count, not the micro-batch count)."""
    split_points: tuple[int, ...] | None = None
    """Indices into the ``nn.Sequential`` where stages 1.. begin (``None``: automatic)."""
    balance: Balance = "params"
    """Automatic split by parameter count, or by measured time per layer
    (``"time"`` needs ``example_input``)."""
    example_input: Any = None
    """A batch-shaped input, used to time layers for ``balance="time"``."""

    def __post_init__(self) -> None:
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise UsageError(f"microbatches must be an integer >= 1, got {self.microbatches!r}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise UsageError(f"unknown pipeline schedule {self.schedule!r}; choose gpipe or 1f1b")
        if self.balance not in ("params", "time"):
            raise UsageError(f"unknown balance {self.balance!r}; choose params or time")
        if self.balance == "time" and self.example_input is None and self.split_points is None:
            raise UsageError("balance='time' times each layer: give example_input (one batch)")


TensorStyle = Literal["colwise", "rowwise"]


@dataclass(frozen=True, kw_only=True)
class TensorOptions:
    """Knobs of ``"tensor"`` (DTensor ``parallelize_module``)."""

    plan: Mapping[str, Any] | None = None
    """Module path -> ``"colwise"``, ``"rowwise"`` or a torch ``ParallelStyle``.
    ``None`` finds a plan for common patterns (q/k/v/out projections, fc1/fc2,
    w1/w2/w3, Linear-act-Linear in a Sequential)."""


# torch.compile's modes (``None``: its default); named here so a typo fails at construction.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How ``Parallel(compile=...)`` calls ``torch.compile`` on the prepared model.

    Each strategy decides *where* it is applied (after DDP wrapping, per FSDP2
    block, per pipeline stage); these are the knobs torch itself takes.
    """

    mode: str | None = None
    """``"default"``, ``"reduce-overhead"`` (CUDA graphs), ``"max-autotune"`` or
    ``"max-autotune-no-cudagraphs"``; ``None`` is torch's default."""
    fullgraph: bool = False
    """Fail on a graph break instead of falling back to eager for that part."""
    dynamic: bool | None = None
    """Compile for dynamic shapes up front (``True``), never (``False``), or when a
    shape changes (``None``, torch's default)."""

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise UsageError(
                f"unknown compile mode {self.mode!r}; choose one of {', '.join(COMPILE_MODES)} "
                "or None"
            )
        if not isinstance(self.fullgraph, bool):
            raise UsageError(
                f"CompileOptions(fullgraph=...) takes True or False, not {self.fullgraph!r}"
            )
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise UsageError(
                f"CompileOptions(dynamic=...) takes True, False or None, not {self.dynamic!r}"
            )

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile`` / ``nn.Module.compile``."""
        return {"mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic}


def compile_in_place(module: Module, options: CompileOptions) -> None:
    """Compile ``module`` in place (``nn.Module.compile``).

    In place rather than ``torch.compile(module)``: the module object, its
    ``state_dict`` keys (no ``_orig_mod.`` prefix) and the hooks strategies put
    on it stay as they are, so checkpoints and ``unwrap`` do not change.
    """
    module.compile(**options.kwargs())


PSMode = Literal["sync", "async"]


@dataclass(frozen=True, kw_only=True)
class PSOptions:
    """Knobs of ``"ps"``: parameter servers (TensorFlow's ``ParameterServerStrategy``).

    The first ``servers`` ranks hold the parameters and the optimizer state,
    split by size; the other ranks are workers that run the training loop,
    push their gradients and pull the updated parameters at each ``step()``.
    """

    servers: int | None = None
    """How many of the job's ranks serve (the first ones). ``None``: the ``K``
    of ``manygpu launch --ps K``, else 1."""
    mode: PSMode = "sync"
    """``"sync"``: each step averages every worker's gradient before one update
    (the same result as one process on the global batch, like ddp).
    ``"async"``: each gradient is applied as it arrives; workers never wait
    for each other (within ``max_staleness``) and a dead worker is dropped."""
    max_staleness: int | None = None
    """``"async"`` only: how many steps a worker may run ahead of the slowest
    live worker, i.e. how many of that worker's updates its parameters may
    lack; it waits beyond that (bounded delay). ``0`` lets no worker start a
    step before every other finished the previous one; ``None``: unbounded."""

    def __post_init__(self) -> None:
        servers = self.servers
        if servers is not None and (
            isinstance(servers, bool) or not isinstance(servers, int) or servers < 1
        ):
            raise UsageError(f"PSOptions(servers=...) takes an integer >= 1, not {servers!r}")
        if self.mode not in ("sync", "async"):
            raise UsageError(f"unknown parameter-server mode {self.mode!r}; choose sync or async")
        s = self.max_staleness
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise UsageError(
                f"PSOptions(max_staleness=...) takes an integer >= 0 or None, not {s!r}"
            )
        if s is not None and self.mode == "sync":
            raise UsageError(
                "max_staleness bounds the lag of mode='async'; a sync step has none: "
                "drop max_staleness or use mode='async'"
            )

    def with_launched(self, launched: int | None) -> PSOptions:
        """These options with ``servers`` decided: the launcher's ``--ps K`` must agree."""
        if launched is not None and self.servers is not None and launched != self.servers:
            raise UsageError(
                f"the script asks for PSOptions(servers={self.servers}) but was launched with "
                f"--ps {launched}; make them agree, or give only one"
            )
        servers = self.servers if self.servers is not None else launched or 1
        return PSOptions(servers=servers, mode=self.mode, max_staleness=self.max_staleness)
