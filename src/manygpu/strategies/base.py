"""The interface every strategy implements, and nothing more.

A strategy decides how a model is wrapped, how gradients are synchronised and
how data is split; the :class:`~manygpu.Parallel` object calls it and never
asks which strategy it is talking to. What only some strategies do (roles,
clipping where gradients are combined, a progress note, ...) are separate
abilities in :mod:`.abilities`, asked for by capability.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from manygpu.errors import UsageError
from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.axes import replica_axis
from manygpu.strategies.mesh import MeshShape, check_axes
from manygpu.strategies.options import CompileOptions, compile_in_place
from manygpu.strategies.registry import StrategyCard, cards
from manygpu.strategies.spec import StrategySpec
from manygpu.transforms.fp8 import check_fp8_strategy
from manygpu.transforms.materialize import Place

if TYPE_CHECKING:
    from manygpu.checkpoint_io.formats import Format


OptionsT = TypeVar("OptionsT", bound=StrategySpec)


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What the job asks of every strategy (its own knobs are on its object)."""

    mesh: MeshShape | None = None
    """Sizes per named axis for strategies that compose (``None``: their default)."""
    precision: str = "fp32"
    """The job's precision, for strategies that must refuse one."""
    grad_accum_steps: int = 1
    """The job's accumulation, for strategies that must refuse it."""
    compile: CompileOptions | None = None
    """``torch.compile`` settings when the job compiles its model (``None``: it does not)."""
    channels_last: bool | None = None
    """The job's channels_last setting (``None``: automatic), for strategies that refuse it."""


def composers() -> str:
    """The strategies that take a mesh, from their cards: ``fsdp, tensor, ...; ddp and
    model take dp`` (those composing replicas alone last)."""
    replicas = (replica_axis(),)
    composing = [c for c in cards() if c.axes()]
    wide = [c.name for c in composing if c.axes() != replicas]
    narrow = [c.name for c in composing if c.axes() == replicas]
    tail = f"{', '.join(narrow[:-1])} and {narrow[-1]}" if len(narrow) > 1 else "".join(narrow)
    return f"{', '.join(wide)}; {tail} take {replicas[0]}" if narrow else ", ".join(wide)


def given_repr(obj: Any) -> str:
    """``FSDP(param_dtype='bf16')``: a dataclass with only the fields that differ from
    their defaults (a strategy object's full repr buries the one option that was set)."""
    shown = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.default is not MISSING:
            default: Any = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        try:
            same = bool(value == default)
        except Exception:  # a value whose == is not a bool (a tensor): show it
            same = False
        if f.repr and not same:
            shown.append(f"{f.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(shown)})"


class Strategy(ABC, Generic[OptionsT]):
    """How one process takes part in training, with the options of its object ``OptionsT``."""

    spec_class: ClassVar[type[StrategySpec]]
    """The object users pick this strategy by (``DDP``); its name and card are this class's."""
    name: ClassVar[str]
    """Registry name, e.g. ``"ddp"`` (from :attr:`spec_class`)."""
    card: ClassVar[StrategyCard]
    """What the planner knows of this strategy: costs, loop, checkpoint format."""
    needs_process_group: ClassVar[bool] = False
    """Create a group even for one process (DDP cannot work without one)."""
    shards_data: ClassVar[bool] = False
    """Whether each rank sees a different part of the data."""
    checkpoint_format: ClassVar[Format]
    """From the card: ``FULL`` (one copy from the main rank) or ``DCP`` (shards)."""
    multi_process: ClassVar[bool]
    """From the card: one process per device (else one process drives them all)."""
    instead: ClassVar[str] = "use strategy='ddp' or launch one process"
    """For a one-process strategy: what to do when the job has several processes."""
    refused_precisions: ClassVar[frozenset[str]] = frozenset()
    """Precisions this strategy cannot train in: ``precision="auto"`` never picks them,
    and an explicit one is refused with :attr:`precision_refusal`."""
    precision_refusal: ClassVar[str] = ""
    """Why those precisions cannot work here and what to do instead."""
    channels_last_weights: ClassVar[bool] = True
    """Whether 4-D weights may be stored channels_last. Where not (FSDP2 shards
    only contiguous parameters), channels_last converts the input batches alone:
    a channels_last input is enough for cuDNN to pick its NHWC kernels."""
    channels_last_refusal: ClassVar[str | None] = None
    """Why ``channels_last=True`` cannot work here and what to do, or ``None``."""
    compile_refusal: ClassVar[str | None] = None
    """Why ``compile=True`` cannot work here and what to do, or ``None``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class naming its object takes the object's name and card (one source)."""
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("spec_class")
        if spec is not None:
            cls.name, cls.card = spec.name, spec.card
            cls.checkpoint_format = spec.card.checkpoint
            cls.multi_process = not spec.card.one_process

    def __init__(self, ctx: DistContext, options: OptionsT, job: JobOptions) -> None:
        self.ctx = ctx
        self.options = options
        """This strategy's object, as the user gave it (``DDP(bucket_cap_mb=50)``)."""
        self.job = job

    def __repr__(self) -> str:
        """``DDPStrategy(DDP(bucket_cap_mb=50))``: what a log or a debugger should show,
        the options the user gave (defaults left out), not an object address."""
        return f"{type(self).__name__}({given_repr(self.options)})"

    @classmethod
    def validate_world(cls, cluster: ClusterInfo, options: OptionsT, job: JobOptions) -> None:
        """Raise :class:`~manygpu.errors.UsageError` if this job shape cannot work.

        Called before any process group exists, so a bad shape fails at once
        on every rank instead of hanging in a rendezvous.
        """
        if not cls.multi_process and cluster.world_size > 1 and job.mesh is None:
            raise UsageError(
                f"strategy {cls.name!r} runs one process that drives its devices, but this "
                f"job has {cluster.world_size} processes; {cls.instead}"
            )
        if job.mesh is None:
            return
        if not cls.card.axes():
            raise UsageError(
                f"strategy {cls.name!r} takes no mesh; give a mesh to a strategy that composes "
                f"its dimensions ({composers()})"
            )
        # A mesh of the axes its card names (a replicating strategy's: replicas only).
        check_axes(cls.name, job.mesh, cls.card.axes())
        job.mesh.resolve(cluster.world_size)

    @classmethod
    def validate_features(cls, options: OptionsT, job: JobOptions) -> None:
        """Refuse what this strategy cannot do with ``options`` in this job (a precision,
        ``compile``, ``channels_last``, a missing option).

        Called after :meth:`validate_world`, before any process group exists.
        """
        if job.precision in cls.refused_precisions:
            raise UsageError(
                f"precision={job.precision!r} does not work with strategy {cls.name!r}: "
                f"{cls.precision_refusal}"
            )
        if job.precision == "fp8":
            check_fp8_strategy(cls)  # fp8 is an ability (transforms/fp8.py), not a default
        if job.compile is not None and cls.compile_refusal is not None:
            raise UsageError(
                f"compile=True does not work with strategy {cls.name!r}: {cls.compile_refusal}"
            )
        if job.channels_last is True and cls.channels_last_refusal is not None:
            raise UsageError(
                f"channels_last=True does not work with strategy {cls.name!r}: "
                f"{cls.channels_last_refusal}"
            )

    def data_shard(self) -> tuple[int, int]:
        """``(index, count)``: which of how many data shards this rank reads."""
        if self.shards_data:
            return self.ctx.rank, self.ctx.world_size
        return 0, 1

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (already scaled); pipelines did it in their forward."""
        loss.backward()

    @abstractmethod
    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        """Split, shard and wrap ``module`` for this strategy; ``place(part, device)``
        each part this rank keeps, *after* splitting or sharding it.

        ``module`` may be on the meta device (built under ``par.init_module()``):
        ``place`` then allocates only what this rank keeps, so sharding before
        placing is what lets a model bigger than one device train. A wrapper that
        needs real values (DDP broadcasts at construction) wraps after ``place``.
        """

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adapt the optimizer (sharded strategies replace it); default: as is."""
        return optimizer

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        """Turn gradient synchronisation for the *next* forward/backward on or off.

        Used for gradient accumulation; strategies without sync ignore it.
        """

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper we added."""
        return module

    def compile_module(self, module: nn.Module, options: CompileOptions) -> None:
        """``torch.compile`` the prepared ``module`` in place, where this strategy needs it.

        Default: the whole prepared module (for DDP that is after wrapping, so
        graph breaks fall on its gradient buckets).
        """
        compile_in_place(module, options)
