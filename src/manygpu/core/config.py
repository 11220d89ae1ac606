"""The configuration of a :class:`~manygpu.Parallel`: frozen, validated on construction."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from manygpu.errors import UsageError
from manygpu.runtime.device import parse_device
from manygpu.strategies import (
    CompileOptions,
    JobOptions,
    MeshShape,
    StrategySpec,
    serving_strategy,
    spec_class,
)
from manygpu.strategies.registry import AUTO, RULES, check_name, resolve_name
from manygpu.tracking.registry import check_names
from manygpu.transforms.checkpointing import ActivationCheckpointing
from manygpu.transforms.checkpointing import parse as parse_checkpointing

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy

Precision = Literal["auto", "fp32", "fp32-strict", "bf16", "fp16", "fp8"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "fp32-strict", "bf16", "fp16", "fp8")
REMOVED_KEYWORDS: dict[str, str] = {
    # Each old keyword was its object's name in lower case (ddp=, fsdp=, ...).
    **{name.lower(): f"{name}(...)" for name in ("DDP", "FSDP", "Pipeline", "Tensor", "PS")},
    "model_stages": "ModelParallel(stages=...)",
}
"""The per-strategy keywords ``Parallel`` took before a strategy object carried its
options (they never shipped in a release), and the object that replaces each."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How to run: which strategy, which precision, how to accumulate."""

    strategy: str | StrategySpec | None = None
    """A strategy object with its options (``FSDP(param_dtype="bf16")``,
    ``DDP(bucket_cap_mb=50)``), or a registry name for its defaults (``"fsdp"``),
    ``"hybrid"`` (the strategy that composes the mesh's dimensions), or
    ``"auto"`` (the planner picks the simplest strategy whose memory fits, when
    the model is prepared); ``None`` picks ``"hybrid"`` when a mesh is given, else
    ``"ddp"`` when launched with several processes and ``"single"`` otherwise."""
    precision: Precision = "auto"
    """``"auto"``: bf16 autocast on GPUs with bf16 (compute capability >= 8.0),
    fp16 with loss scaling on older GPUs, fp32 on the CPU. ``"bf16"`` autocasts
    to bfloat16; ``"fp16"`` also scales the loss; weights and optimizer state
    stay fp32 in each. On CUDA, matmuls and convolutions left in fp32 use TF32
    unless ``"fp32-strict"``. ``"fp8"`` (opt-in, never chosen by ``"auto"``):
    torchao's float8 linears in bf16 autocast, on GPUs with compute capability
    >= 8.9 (:mod:`manygpu.transforms.fp8`)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; sync only on the last one."""
    seed: int | None = 0
    """Seeds python/numpy/torch with ``seed + rank`` and the samplers with
    ``seed``; ``None`` leaves the RNGs alone."""
    split_batches: bool = False
    """Treat a loader's ``batch_size`` as the global batch and split it over
    ranks (Accelerate's option); by default it is the per-rank batch."""
    timeout_s: float | None = None
    """Collective/rendezvous timeout; ``None`` reads ``MANYGPU_TIMEOUT`` or
    uses 180 s."""
    backend: str | None = None
    """Force a backend (``"gloo"``, ``"nccl"``); default from the device."""
    device: str | None = None
    """Force a device (``"cpu"``); default ``cuda:LOCAL_RANK`` or CPU."""
    mesh: MeshShape | Mapping[str, int] | None = None
    """Sizes per named axis (``pp``, ``dp``, ``fsdp``, ``tp``: the table in
    :mod:`manygpu.strategies.axes`), e.g.
    ``{"dp": 2, "tp": -1}``; ``-1`` is inferred from the world size."""
    channels_last: bool | None = None
    """Store 4-D weights and image batches channels_last (NHWC), which convolution
    kernels on GPUs run fastest on. ``None``: on for a model with ``nn.Conv2d``
    on CUDA; ``True`` also on the CPU; ``False``: off."""
    compile: bool | CompileOptions = False
    """``torch.compile`` the prepared model where its strategy needs it (after
    DDP wrapping, per FSDP2 block, per pipeline stage); ``CompileOptions`` sets
    mode, fullgraph and dynamic."""
    activation_checkpointing: bool | str | int | ActivationCheckpointing | None = None
    """Keep less for the backward and recompute the rest, per block (the blocks
    FSDP2 makes units, or ``block_classes``): ``"full"`` recomputes every block,
    ``N`` every N-th block, ``"selective"`` keeps the blocks' matmul and
    attention outputs and recomputes only cheap ops; ``ActivationCheckpointing(
    ...)`` also names the blocks; ``None``/``False``: off."""
    stragglers: bool | int = True
    """Every N steps (``True``: 50) gather each rank's step split (input wait,
    compute, exposed communication) to the main rank, which names a rank or host
    that stays slower than its peers (``manygpu: straggler: ...``); ``False`` (or
    ``MANYGPU_STRAGGLERS=0``) turns the reports off."""
    debug: bool | None = None
    """Check before each collective of :meth:`Parallel.reduce` / ``gather`` /
    ``barrier`` that every rank calls the same one (shape, dtype); ``None``
    reads ``MANYGPU_DEBUG``."""
    log_with: str | Sequence[str] | None = None
    """Experiment trackers :meth:`Parallel.log` writes to: ``"tensorboard"``,
    ``"mlflow"``, ``"wandb"``, ``"jsonl"`` (a name or a list); each but jsonl is an
    optional extra, imported only when named. One run per job, written by the
    main rank; checkpoints carry its id so a resumed job continues it."""
    run_dir: str | None = None
    """Where the trackers' files go (``<run_dir>/<run id>/``), on a filesystem the
    main rank of a resumed job sees too; ``None``: ``runs``."""

    def __post_init__(self) -> None:
        if self.mesh is not None:
            object.__setattr__(self, "mesh", MeshShape.parse(self.mesh))
        self._check_strategy()
        if self.precision not in PRECISIONS:
            raise UsageError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        if self.channels_last is not None and not isinstance(self.channels_last, bool):
            raise UsageError(
                f"channels_last takes True, False or None (automatic), not {self.channels_last!r}"
            )
        if not isinstance(self.compile, bool | CompileOptions):
            raise UsageError(
                f"compile takes True, False or a CompileOptions(mode=..., fullgraph=..., "
                f"dynamic=...), not {self.compile!r}"
            )
        parse_checkpointing(self.activation_checkpointing)  # a typo fails here
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise UsageError(
                f"grad_accum_steps must be an integer >= 1, got {self.grad_accum_steps!r}"
            )
        object.__setattr__(self, "log_with", check_names(self.log_with))
        k = self.stragglers
        if not isinstance(k, bool) and (not isinstance(k, int) or k < 1):
            raise UsageError(f"stragglers takes True, False or steps per report >= 1, not {k!r}")
        if self.device is not None:
            parse_device(self.device)  # a typo fails here, before any process group
        t = self.timeout_s
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0
        ):
            raise UsageError(f"timeout_s must be a finite number of seconds > 0, got {t!r}")

    def __new__(cls, *args: Any, **fields: Any) -> ParallelConfig:
        """Refuse, in one line, a keyword that was removed (before the dataclass's own
        ``__init__`` would say only "unexpected keyword argument"): ``Parallel(**fields)``
        builds its config here, so this covers both doors."""
        removed = [k for k in REMOVED_KEYWORDS if k in fields]
        if removed:
            k = removed[0]
            raise UsageError(f"Parallel({k}=...) was removed: use strategy={REMOVED_KEYWORDS[k]}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in fields if k not in known]
        if unknown:
            raise UsageError(unknown_keyword(unknown[0], known))
        return super().__new__(cls)

    def _check_strategy(self) -> None:
        if isinstance(self.strategy, StrategySpec):
            return
        if isinstance(self.strategy, type) and issubclass(self.strategy, StrategySpec):
            raise UsageError(
                f"strategy={self.strategy.__name__} is the class: give an object, "
                f"strategy={self.strategy.__name__}()"
            )
        if self.strategy is not None and not isinstance(self.strategy, str):
            raise UsageError(
                f"strategy takes a name ('ddp') or a strategy object (DDP(...)), "
                f"not {self.strategy!r}"
            )
        check_name(self.strategy, self.mesh is not None)
        if self.strategy is not None and self.strategy not in RULES:
            self.strategy_object(self.strategy)  # a name whose object needs arguments

    def strategy_object(self, name: str) -> StrategySpec:
        """The object of strategy ``name``: the one given, else its defaults."""
        if isinstance(self.strategy, StrategySpec) and self.strategy.name == name:
            return self.strategy
        return spec_class(name).from_name()

    def job_options(self, precision: str) -> JobOptions:
        """What every strategy is told of the job, with ``precision`` as resolved."""
        return JobOptions(
            mesh=self.mesh if isinstance(self.mesh, MeshShape) else None,
            precision=precision,
            grad_accum_steps=self.grad_accum_steps,
            compile=self.compile_options,
            channels_last=self.channels_last,
        )

    @property
    def compile_options(self) -> CompileOptions | None:
        """What ``compile`` asks for as options (``True``: torch's defaults), or ``None``."""
        if isinstance(self.compile, CompileOptions):
            return self.compile
        return CompileOptions() if self.compile else None

    @property
    def planned(self) -> bool:
        """Whether the planner picks the strategy once the model is known (``"auto"``)."""
        return self.strategy == AUTO

    def resolved_strategy(self, world_size: int, *, served: bool = False) -> str:
        """The strategy name actually used for a job of ``world_size``.

        ``served``: launched with parameter servers (``manygpu launch --ps K``),
        which then is the strategy unless the script names one.
        """
        if isinstance(self.strategy, StrategySpec):
            return self.strategy.name
        mesh = self.mesh if isinstance(self.mesh, MeshShape) else None
        return resolve_name(self.strategy, mesh, world_size, served)


def unknown_keyword(name: str, known: Sequence[str]) -> str:
    """One line for a keyword ``Parallel`` does not take: the nearest one, then every choice
    (a misspelt ``precision=`` was a bare ``TypeError`` from the dataclass)."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" did you mean {close[0]}=?" if close else ""
    return f"Parallel takes no keyword {name}=;{hint} it takes: {', '.join(known)}"


def served_class(options: StrategySpec, launched_servers: int | None) -> type[Strategy[Any]]:
    """The strategy's class; ``manygpu launch --ps K`` (``launched_servers``) makes the
    first K ranks servers, and only a serving strategy fits."""
    strategy_cls = options.implementation()
    if launched_servers is not None and not strategy_cls.card.serves:
        raise UsageError(
            f"launched with --ps {launched_servers} (parameter servers), but the script asks "
            f"for strategy {strategy_cls.name!r}: use strategy={serving_strategy()!r} or "
            "launch without --ps"
        )
    return strategy_cls
