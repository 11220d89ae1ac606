"""``"pipeline"``: one stage of an ``nn.Sequential`` per rank, micro-batches streamed.

Built on ``torch.distributed.pipelining``: a :class:`PipelineStage` per rank
and a GPipe or 1F1B schedule. A schedule runs forward *and* backward for all
micro-batches in one call, so the prepared model does too::

    loss = model(x, target=y)   # every rank: the mean loss, from the last stage
    par.backward(loss)          # nothing left to do (kept so loops look the same)
    opt.step()

Gradients equal those of one big batch when ``loss_fn`` is mean-reduced and
the batch divides evenly into micro-batches (the schedule scales by 1/M).
With ``dp``/``fsdp`` mesh dimensions each stage is also data-parallel over
its replicas (FSDP2 over the data dimensions). Each stage keeps the layer
names of the original model ("3.weight"), so checkpoints of different stages
never collide and load into the unsplit model.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from manygpu import comm
from manygpu.comm.common import describe, wait
from manygpu.comm.objects import broadcast_json, parse_each
from manygpu.errors import UsageError
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.base import JobOptions
from manygpu.strategies.fsdp.sharding import fsdp_kwargs, set_fsdp_grad_sync, shard_data_dims
from manygpu.strategies.mesh import job_mesh
from manygpu.strategies.options import CompileOptions, compile_in_place
from manygpu.strategies.pipeline import Pipeline
from manygpu.strategies.sharded import MeshStrategy
from manygpu.strategies.splitting import (
    balanced_cuts,
    layer_times,
    param_sizes,
    starts_from_split_points,
)
from manygpu.transforms.materialize import Place, has_meta

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class PipelineStrategy(MeshStrategy[Pipeline]):
    """Pipeline parallelism over the ``pp`` mesh dimension (optionally x dp / fsdp)."""

    spec_class = Pipeline

    needs_process_group = True
    shards_data = True
    _pp_group: Any = None  # set by setup_module
    refused_precisions = frozenset({"fp16"})
    precision_refusal = (
        "it does not scale fp16 losses across stages; use precision='bf16' or 'fp32'"
    )
    channels_last_refusal = (
        "its stages receive activations into contiguous buffers, not channels_last ones; "
        "leave channels_last unset or False"
    )

    def __init__(self, ctx: DistContext, options: Pipeline, job: JobOptions) -> None:
        super().__init__(ctx, options, job)
        self._pipelines: list[PipelinedModel] = []
        """The models this strategy prepared: a loss they returned has had its backward."""

    @classmethod
    def validate_world(cls, cluster: Any, options: Pipeline, job: JobOptions) -> None:
        super().validate_world(cluster, options, job)
        points = options.split_points
        stages = cls.resolve_mesh(cluster.world_size, job).pp
        if options.schedule == "1f1b" and options.microbatches < stages:
            raise UsageError(
                f"Pipeline(schedule='1f1b') needs at least one micro-batch per stage: "
                f"microbatches={options.microbatches} < {stages} stages; raise microbatches "
                "or use schedule='gpipe'"
            )
        if points is not None and len(points) != stages - 1:
            raise UsageError(
                f"split_points {list(points)} gives {len(points) + 1} stages but the "
                f"pipeline has {stages} (mesh pp={stages}); give {stages - 1} split point(s)"
            )

    @classmethod
    def validate_features(cls, options: Pipeline, job: JobOptions) -> None:
        super().validate_features(options, job)
        if options.loss_fn is None:
            raise UsageError(
                "strategy 'pipeline' computes the loss on the last stage: give "
                "strategy=Pipeline(loss_fn=...), e.g. torch.nn.functional.cross_entropy"
            )
        if job.grad_accum_steps != 1:
            raise UsageError(
                "strategy 'pipeline' accumulates over micro-batches already: set "
                "grad_accum_steps=1 and raise strategy=Pipeline(microbatches=...) instead"
            )

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        if not isinstance(module, nn.Sequential):
            raise UsageError(
                "strategy 'pipeline' splits an nn.Sequential into stages; wrap your layers "
                f"in one, not a {type(module).__name__}"
            )
        opts = self.options
        device = self.ctx.device
        names = self.mesh_names
        mesh = job_mesh(self.ctx, self.shape, names)
        index, stages = self.shape.coords(self.ctx.rank)["pp"], self.shape.pp
        if has_meta(module) and opts.balance == "time" and opts.split_points is None:
            raise UsageError(
                "Pipeline(balance='time') times each layer on real values, and this model "
                "was built empty (init_module()): use balance='params' or give split_points"
            )
        bounds = [*self._stage_starts(module, stages), len(module)]
        part = nn.Sequential(
            OrderedDict((str(i), module[i]) for i in range(bounds[index], bounds[index + 1]))
        )
        if self.data_names:
            kwargs = fsdp_kwargs(self.options.fsdp, self.ctx.device, reshard_after_forward=False)
            shard_data_dims(part, mesh[self.data_names], kwargs, children=False)
        place(part, device)  # this stage only, (sharded and) then allocated in place
        pp_group = mesh["pp"].get_group()
        self._pp_group = pp_group
        last_rank = dist.get_global_rank(pp_group, stages - 1)
        wrapped = PipelinedModel(part, index, stages, last_rank, pp_group)
        wrapped.attach(
            _SCHEDULES[opts.schedule],
            lambda: PipelineStage(part, index, stages, device, group=pp_group),
            opts.microbatches,
            opts.loss_fn,
        )
        wrapped.timeout_s = self.ctx.timeout_s
        self._pipelines.append(wrapped)
        return wrapped

    def _stage_starts(self, module: nn.Sequential, stages: int) -> list[int]:
        """Where each stage begins: the user's split points, or balanced ones."""
        opts = self.options
        if opts.split_points is not None:
            return starts_from_split_points(opts.split_points, len(module), stages)
        if opts.balance == "params":
            return balanced_cuts(param_sizes(module), stages)
        times = torch.tensor(layer_times(module, opts.example_input, self.ctx.device))
        # Every rank timed every layer; cut on the mean so all ranks agree on the cuts.
        times = comm.all_reduce(times.to(self.ctx.device), "mean", timeout_s=self.ctx.timeout_s)
        return balanced_cuts(times.cpu().tolist(), stages)

    def backpropagated_loss_scale(self) -> float:
        """torch's schedules divide the gradients by the micro-batches (``scale_grads``):
        a ``loss_fn`` returning a sum over tokens is backpropagated as sum / M."""
        return float(self.options.microbatches)

    def compile_module(self, module: nn.Module, options: CompileOptions) -> None:
        """Compile this rank's stage: the schedule, sends and receives stay eager."""
        stage = module.stage if isinstance(module, PipelinedModel) else module
        compile_in_place(stage, options)

    def timing_peers(self) -> int:
        # Stages do different work: a rank's step compares with its stage's replicas.
        return int(self.shape.coords(self.ctx.rank)["pp"])

    def grad_norm_group(self) -> object | None:
        # Each stage holds different layers: the model's norm sums over stages.
        return self._pp_group

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        if isinstance(module, PipelinedModel):
            set_fsdp_grad_sync(module.stage, enabled)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.stage if isinstance(module, PipelinedModel) else module

    def backward(self, loss: torch.Tensor) -> None:
        if not any(p.ran_backward_for(loss) for p in self._pipelines):
            raise UsageError(
                "with strategy 'pipeline' the model runs forward and backward together: "
                "loss = model(x, target=y); then par.backward(loss)"
            )


class PipelinedModel(nn.Module):
    """This rank's stage plus the schedule that drives all stages together.

    ``model(x, target=y)`` in training mode runs the schedule's forward and
    backward and returns the mean micro-batch loss on every rank. In eval mode
    (or under ``torch.no_grad()``) it runs forwards only and returns the loss
    if a target is given, else the last stage's output, on every rank.
    """

    timeout_s: float = 180.0
    microbatches: int = 1

    def __init__(
        self, stage: nn.Sequential, index: int, stages: int, last_rank: int, group: Any
    ) -> None:
        super().__init__()
        self.stage = stage
        self._index, self._stages = index, stages
        self._last_rank, self._group = last_rank, group
        self._outputs_only = False
        self._schedule: Any = None
        self._make_schedule: Callable[[], Any] = lambda: None
        self._shape: tuple[Any, ...] | None = None
        self._loss_fn: Any = None
        self._trained: weakref.ref[torch.Tensor] | None = None

    def ran_backward_for(self, loss: torch.Tensor) -> bool:
        """Whether ``loss`` is the one our last training step returned (its backward is done)."""
        return self._trained is not None and self._trained() is loss

    def attach(
        self,
        schedule_cls: Any,
        make_stage: Callable[[], PipelineStage],
        microbatches: int,
        loss: Any,
    ) -> None:
        """Drive our stage with a schedule whose loss we can switch off for plain outputs."""
        self._loss_fn = loss
        self.microbatches = microbatches
        self._make_schedule = lambda: schedule_cls(make_stage(), microbatches, loss_fn=self._loss)
        self._schedule = self._make_schedule()

    def _fit_schedule(self, args: tuple[Any, ...]) -> None:
        """A new stage and schedule when the batch shape changes (a smaller last batch).

        A stage infers the shapes of what it receives on its first step and
        keeps those buffers: a smaller batch would arrive as the old shape.
        Every rank sees the same batch shape, so all rebuild together.
        """
        shape = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        if self._shape is not None and shape != self._shape:
            self._schedule = self._make_schedule()
        self._shape = shape

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # One schedule serves training and evaluation (torch re-initialises its
        # buffers when it switches); for outputs only, the target is a dummy.
        if self._outputs_only:
            return output.detach().sum() * 0
        return self._loss_fn(output, target)

    @property
    def is_first(self) -> bool:
        """Whether this rank feeds the pipeline's inputs."""
        return self._index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank computes outputs and losses."""
        return self._index == self._stages - 1

    def forward(self, *args: Any, target: torch.Tensor | None = None) -> torch.Tensor:
        self._check_batch(args)
        self._fit_schedule(args)
        inputs = args if self.is_first else ()
        label = target if self.is_last else None
        losses: list[torch.Tensor] = []
        if self.training and torch.is_grad_enabled():
            if target is None:
                raise UsageError(
                    "a pipeline trains on model(x, target=y); call model.eval() for outputs only"
                )
            self._schedule.step(*inputs, target=label, losses=losses)
            loss = self._share_loss(losses)
            self._trained = weakref.ref(loss)
            return loss
        self._outputs_only = target is None
        if self._outputs_only and self.is_last:
            label = torch.zeros(args[0].shape[0] if args else self.microbatches)
        try:
            with torch.no_grad():
                output = self._schedule.eval(*inputs, target=label, losses=losses)
        finally:
            self._outputs_only = False
        if target is not None:
            return self._share_loss(losses)
        return self._share_output(output)

    def _check_batch(self, args: tuple[Any, ...]) -> None:
        # Every rank is given the batch, so every rank refuses it alike (no hang).
        if args and isinstance(args[0], torch.Tensor):
            rows = args[0].shape[0]
            if rows % self.microbatches:
                raise UsageError(
                    f"batch of {rows} does not split into {self.microbatches} equal "
                    "micro-batches; make the batch size a multiple of microbatches "
                    "(drop_last=True on the loader keeps the last batch whole)"
                )

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean micro-batch loss, computed on the last stage, on every rank."""
        device = next(iter(self.stage.parameters()), torch.empty(0)).device
        value = torch.zeros((), dtype=torch.float32, device=device)
        if self.is_last:
            value = torch.stack([loss.detach().float() for loss in losses]).mean().to(device)
        return self._broadcast(value)

    def _share_output(self, output: Any) -> torch.Tensor:
        """The last stage's output on every rank (shape and dtype sent first, as JSON)."""
        meta = [list(output.shape), _dtype_name(output.dtype)] if self.is_last else None
        sent = broadcast_json(
            meta,
            self._last_rank,
            operation=_OUTPUT_META,
            timeout_s=self.timeout_s,
            group=self._group,
        )
        [(shape, dtype)] = parse_each(
            [sent], _output_meta, operation=_OUTPUT_META, first_sender=self._last_rank
        )
        device = next(iter(self.stage.parameters()), torch.empty(0)).device
        buf = output.to(device) if self.is_last else torch.empty(shape, dtype=dtype, device=device)
        return self._broadcast(buf)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        work = dist.broadcast(tensor, src=self._last_rank, group=self._group, async_op=True)
        wait(work, describe("pipeline broadcast from last stage", tensor), self.timeout_s)
        return tensor


_OUTPUT_META = "pipeline output's shape and dtype"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {_dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
"""Every dtype by name: a name received is looked up here, never ``getattr``'d."""


def _output_meta(sent: Any) -> tuple[list[int], torch.dtype]:
    """``[shape, dtype name]`` as :meth:`PipelinedModel._share_output` sends it, checked."""
    shape, name = sent  # a ValueError when it is not a pair
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise TypeError(f"{name!r:.40} is not a torch dtype")
    sizes = isinstance(shape, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    )
    if not sizes:
        raise TypeError(f"shape {shape!r:.80} is not a list of sizes")
    return shape, dtype
