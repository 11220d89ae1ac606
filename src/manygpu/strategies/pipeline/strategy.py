"""``"pipeline"``: stages of an ``nn.Sequential`` over ranks, micro-batches streamed.

Built on ``torch.distributed.pipelining``: a :class:`PipelineStage` per stage
a rank holds (one, or several for the interleaved and V schedules: see
:mod:`.schedules`) and torch's schedule of that name. A schedule runs forward *and* backward for all
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
from torch.distributed.pipelining import PipelineStage, schedules

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
from manygpu.strategies.pipeline.schedules import (
    info,
    last_stage_rank,
    microbatch_refusal,
    stages_of_rank,
    virtual_stages,
)
from manygpu.strategies.sharded import MeshStrategy
from manygpu.strategies.splitting import (
    balanced_cuts,
    layer_times,
    param_sizes,
    starts_from_split_points,
)
from manygpu.transforms.materialize import Place, has_meta


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
        pp = cls.resolve_mesh(cluster.world_size, job).pp
        virtual = virtual_stages(options.schedule, options.virtual_stages)
        refusal = microbatch_refusal(options.schedule, pp, virtual, options.microbatches)
        if refusal:
            raise UsageError(refusal)
        stages = pp * virtual
        if points is not None and len(points) != stages - 1:
            per = f" x {virtual} virtual stages" if virtual > 1 else ""
            raise UsageError(
                f"split_points {list(points)} gives {len(points) + 1} stages but the "
                f"pipeline has {stages} (mesh pp={pp}{per}); give {stages - 1} split point(s)"
            )

    @classmethod
    def validate_features(cls, options: Pipeline, job: JobOptions) -> None:
        super().validate_features(options, job)
        if options.loss_fn is None:
            raise UsageError(
                "strategy 'pipeline' computes the loss on the last stage: give "
                "strategy=Pipeline(loss_fn=...), e.g. torch.nn.functional.cross_entropy"
            )
        if job.compile is not None and info(options.schedule).weight_split:
            raise UsageError(
                f"Pipeline(schedule={options.schedule!r}) splits each backward in two, which "
                "torch.compile does not support: use schedule='interleaved-1f1b', or do not "
                "compile"
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
        sched = info(opts.schedule)
        virtual = virtual_stages(opts.schedule, opts.virtual_stages)
        if virtual > 1 and len(module) < stages * virtual:
            raise UsageError(
                f"cannot split {len(module)} layers into {stages} ranks x {virtual} virtual "
                f"stages = {stages * virtual} stages; lower virtual_stages or use "
                "schedule='1f1b'"
            )
        bounds = [*self._stage_starts(module, stages * virtual), len(module)]
        held = stages_of_rank(index, stages, virtual, sched.style)
        chunks = [_layers(module, range(bounds[i], bounds[i + 1])) for i in held]
        # Several stages: one module of every layer this rank holds, named as in the
        # whole model, is what checkpoints and the optimizer see; the stages (each its
        # own FSDP root over the data dims) share its layers.
        part = chunks[0] if len(chunks) == 1 else _layers(module, _held_layers(chunks))
        if self.data_names:
            kwargs = fsdp_kwargs(self.options.fsdp, self.ctx.device, reshard_after_forward=False)
            for chunk in chunks:
                shard_data_dims(chunk, mesh[self.data_names], kwargs, children=False)
        place(part, device)  # this rank's stages only, (sharded and) then allocated in place
        pp_group = mesh["pp"].get_group()
        self._pp_group = pp_group
        last_rank = dist.get_global_rank(pp_group, last_stage_rank(stages, sched.style))
        total = stages * virtual
        wrapped = PipelinedModel(part, index, stages, last_rank, pp_group)
        wrapped.holds(chunks, first=0 in held, last=total - 1 in held)

        def make_stages() -> Any:
            made = [
                PipelineStage(chunk, i, total, device, group=pp_group)
                for i, chunk in zip(held, chunks, strict=True)
            ]
            return made if sched.multi else made[0]

        wrapped.attach(
            getattr(schedules, sched.torch_name), make_stages, opts.microbatches, opts.loss_fn
        )
        if sched.style == "v":
            wrapped.evaluate_with(_forward_only)
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
        for stage in module.chunks if isinstance(module, PipelinedModel) else [module]:
            compile_in_place(stage, options)

    def timing_peers(self) -> int:
        # Stages do different work: a rank's step compares with its stage's replicas.
        return int(self.shape.coords(self.ctx.rank)["pp"])

    def grad_norm_group(self) -> object | None:
        # Each stage holds different layers: the model's norm sums over stages.
        return self._pp_group

    def set_grad_sync(self, module: nn.Module, enabled: bool) -> None:
        if isinstance(module, PipelinedModel):
            for stage in module.chunks:
                set_fsdp_grad_sync(stage, enabled)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.stage if isinstance(module, PipelinedModel) else module

    def backward(self, loss: torch.Tensor) -> None:
        if not any(p.ran_backward_for(loss) for p in self._pipelines):
            raise UsageError(
                "with strategy 'pipeline' the model runs forward and backward together: "
                "loss = model(x, target=y); then par.backward(loss)"
            )


_BACKWARD_ACTIONS = frozenset({"B", "I", "W", "SEND_B", "RECV_B", "REDUCE_GRAD"})


def _forward_only(schedule: Any) -> Any:
    """``schedule`` with its backward actions taken out of its plan (an evaluation).

    torch 2.13's V schedules (ZBV, DualPipeV) run their backward actions in
    ``eval()`` too, and fail where two adjacent stages share a rank. Their
    lowered plan (``pipeline_order_with_comms``, the one private name used
    here) with only the forwards, their sends and receives left keeps each
    rank's forwards in the order that already ran without deadlock: nothing a
    forward waits for was removed.
    """

    def forwards(action: Any) -> list[Any]:
        kind = action.computation_type.value
        if kind == "OVERLAP_F_B":  # DualPipeV's overlapped pair: its forward only
            return [a for a in action.sub_actions if a.computation_type.value == "F"]
        return [] if kind in _BACKWARD_ACTIONS else [action]

    plan = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {
        rank: [kept for action in actions for kept in forwards(action)]
        for rank, actions in plan.items()
    }
    return schedule


def _held_layers(chunks: list[nn.Sequential]) -> list[int]:
    return [int(name) for chunk in chunks for name in chunk._modules]


def _layers(module: nn.Sequential, indices: Any) -> nn.Sequential:
    """The layers of ``module`` at ``indices``, keeping their names ("3", "7")."""
    return nn.Sequential(OrderedDict((str(i), module[i]) for i in indices))


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
        self._first, self._last = index == 0, index == stages - 1
        self.chunks = [stage]
        self._last_rank, self._group = last_rank, group
        self._outputs_only = False
        self._schedule: Any = None
        self._make_schedule: Callable[[], Any] = lambda: None
        self._make_eval: Callable[[], Any] | None = None
        self._eval_schedule: Any = None
        self._shape: tuple[Any, ...] | None = None
        self._loss_fn: Any = None
        self._trained: weakref.ref[torch.Tensor] | None = None

    def holds(self, chunks: list[nn.Sequential], *, first: bool, last: bool) -> None:
        """The stages this rank runs (their layers are :attr:`stage`'s), and whether it
        holds the first (feeds inputs) and the last (the loss): in a V, rank 0 holds both."""
        self.chunks = chunks
        self._first, self._last = first, last

    def ran_backward_for(self, loss: torch.Tensor) -> bool:
        """Whether ``loss`` is the one our last training step returned (its backward is done)."""
        return self._trained is not None and self._trained() is loss

    def attach(
        self,
        schedule_cls: Any,
        make_stage: Callable[[], PipelineStage | list[PipelineStage]],
        microbatches: int,
        loss: Any,
    ) -> None:
        """Drive our stage with a schedule whose loss we can switch off for plain outputs."""
        self._loss_fn = loss
        self.microbatches = microbatches
        self._make_schedule = lambda: schedule_cls(make_stage(), microbatches, loss_fn=self._loss)
        self._schedule = self._make_schedule()
        self._eval_schedule = self._schedule

    def evaluate_with(self, replan: Callable[[Any], Any]) -> None:
        """Evaluate with a schedule of its own: ``replan`` of a fresh one (made on first use)."""
        self._make_eval = lambda: replan(self._make_schedule())
        self._eval_schedule = None

    def _fit_schedule(self, args: tuple[Any, ...]) -> None:
        """A new stage and schedule when the batch shape changes (a smaller last batch).

        A stage infers the shapes of what it receives on its first step and
        keeps those buffers: a smaller batch would arrive as the old shape.
        Every rank sees the same batch shape, so all rebuild together.
        """
        shape = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        if self._shape is not None and shape != self._shape:
            self._schedule = self._make_schedule()
            self._eval_schedule = None if self._make_eval else self._schedule
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
        return self._first

    @property
    def is_last(self) -> bool:
        """Whether this rank computes outputs and losses."""
        return self._last

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
            if self._eval_schedule is None:
                self._eval_schedule = self._make_eval() if self._make_eval else self._schedule
            with torch.no_grad():
                output = self._eval_schedule.eval(*inputs, target=label, losses=losses)
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
