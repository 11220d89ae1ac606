"""The one object a training script talks to.

``Parallel`` knows which process this is, owns the process group, and prepares
model, optimizer and data for the chosen strategy. It never branches on the
strategy's name: the strategy object does the strategy-specific work.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from manygpu import comm
from manygpu.comm.common import debug_requested, first_line
from manygpu.comm.debug import check_end
from manygpu.comm.grad_norm import clip_grads_, total_grad_norm
from manygpu.comm.module_sync import broadcast_module_state
from manygpu.core import straggler_board
from manygpu.core.accumulation import Accumulator
from manygpu.core.auto import choose_strategy
from manygpu.core.config import ParallelConfig, served_class
from manygpu.core.console import MainConsole
from manygpu.core.data import PreparedLoader, rebuild_loader
from manygpu.core.fp8 import planned_precision
from manygpu.core.job_comm import JobCollectives
from manygpu.core.optimizer import PreparedOptimizer
from manygpu.core.precision import (
    PrecisionChoice,
    PrecisionPlugin,
    announcement,
    apply_tf32,
    cuda_facts,
    resolve_precision,
)
from manygpu.core.profiling import Profiling
from manygpu.core.rebind import ParameterRebinder
from manygpu.core.run_log import RunLog
from manygpu.core.speed import (
    check_compiler,
    fused_step_applies,
    has_conv2d,
    param_device_types,
    to_channels_last,
    use_fused_step,
    wants_channels_last,
)
from manygpu.core.streams import prepare_stream
from manygpu.errors import CollectiveTimeoutError, UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import ClusterInfo, detect_cluster
from manygpu.runtime.device import choose_backend, choose_device, set_cpu_threads
from manygpu.runtime.process_group import init_distributed, teardown
from manygpu.strategies import (
    Strategy,
    StrategySpec,
    abilities,
)
from manygpu.strategies.checkpointing import apply as apply_checkpointing
from manygpu.warn import warn_user

if TYPE_CHECKING:
    from manygpu.checkpoint_io.formats import Parts

T = TypeVar("T")

# Backend messages that mean "a peer never answered" rather than a bug in the model.
_PEER_FAILURE_HINTS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
)


class Parallel(JobCollectives, Profiling, RunLog):
    """Prepare a model, optimizer and data loaders for one strategy.

    Example::

        par = Parallel(strategy="ddp", precision="bf16")
        model, opt, loader = par.prepare(model, opt, loader)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            par.backward(loss)
            opt.step()
            opt.zero_grad()

    Args:
        config: a full :class:`ParallelConfig`; or give its fields as keywords.
        cluster: override environment detection (tests, embedding).
    """

    def __init__(
        self,
        config: ParallelConfig | None = None,
        *,
        cluster: ClusterInfo | None = None,
        **fields: Any,
    ) -> None:
        environ = envmod.current()
        if config is None:  # the code's own fields win over the launcher's defaults
            config = ParallelConfig(**(envmod.launcher_defaults(environ, fields) | fields))
        self.config = config
        self.cluster = cluster if cluster is not None else detect_cluster(environ)
        self.strategy_name = self.config.resolved_strategy(
            self.cluster.world_size, served=envmod.launched_servers(environ) is not None
        )
        options = self.config.strategy_object(self.strategy_name)
        strategy_cls = served_class(options, envmod.launched_servers(environ))
        options = options.launched(environ)
        device = self._device(strategy_cls, options, environ)
        capability, self._device_name = cuda_facts(device)
        self.precision_choice: PrecisionChoice = resolve_precision(
            self.config.precision, device_type=device.type, capability=capability,
            refused=strategy_cls.refused_precisions, fp8_emulate=envmod.fp8_emulate(environ),
        )  # fmt: skip
        """What ``precision=`` became on this device (``"auto"`` resolved)."""
        job = self.config.job_options(self.precision_choice.precision)
        strategy_cls.validate_world(self.cluster, options, job)
        strategy_cls.validate_features(options, job)
        self.timeout_s = self.config.timeout_s or envmod.timeout_s(environ)
        self._bind_device(device, environ)
        self._ctx = abilities.join(
            strategy_cls,
            self.cluster,
            options,
            job,
            device=device,
            backend=choose_backend(device, self.config.backend),
            timeout_s=self.timeout_s,
        )
        # The job as this rank's role sees it: a parameter-server job's workers
        # count workers only (the servers never run the loop).
        self.cluster = self._ctx.cluster
        self.strategy: Strategy[Any] = strategy_cls(self._ctx, options, job)
        self.precision = PrecisionPlugin.chosen(self.precision_choice, device)
        self._restore_tf32 = apply_tf32(self.precision_choice)
        self._channels_last = False  # set when a prepared model runs channels_last
        self._accumulator = Accumulator(self.config.grad_accum_steps)
        self._models: list[nn.Module] = []
        self._model_inputs: list[nn.Module] = []  # what users passed: a second prepare is refused
        self._optimizer_inputs: list[torch.optim.Optimizer] = []
        self._rebinder = ParameterRebinder()
        self._auto_batch = 32  # per-device batch the planner assumes for "auto"
        self._optimizers: list[PreparedOptimizer] = []
        self.console = MainConsole(self.is_main, self.rank)
        self._steps = self._step_reports(environ)
        if (said := announcement(self.precision_choice, self._device_name)) is not None:
            self.print(said)
        self._preflight_tracking()  # a missing extra or refused store: one line, now
        if self.config.seed is not None:
            self.seed_everything(self.config.seed)

    # -- identity --------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.cluster.rank

    @property
    def local_rank(self) -> int:
        """Rank on this node."""
        return self.cluster.local_rank

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return self.cluster.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that logs and saves (never a parameter server)."""
        return self.cluster.is_main and not self.is_server

    @property
    def is_server(self) -> bool:
        """True on a parameter server (strategy ``"ps"``): its ``prepare`` serves the
        workers and then ends the process with exit code 0, so code after it runs on
        workers only."""
        return abilities.is_server(self.strategy)

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._ctx.device

    @property
    def sync_gradients(self) -> bool:
        """Whether the last ``backward`` ended an accumulation cycle (the optimizer steps)."""
        return self._accumulator.last_synced

    # -- preparation -----------------------------------------------------------
    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers and training loaders; returns them in the same order.

        Models are prepared before optimizers whatever the order given, because
        wrapping may move parameters. Pass evaluation loaders to
        :meth:`prepare_loader` with ``train=False`` instead.
        """
        prepared: list[Any] = list(objects)
        loaders = [o for o in objects if isinstance(o, DataLoader) and o.batch_size]
        self._auto_batch = int(loaders[0].batch_size or 1) if loaders else self._auto_batch
        for i, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                prepared[i] = self.prepare_model(obj)
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer):
                prepared[i] = self.prepare_optimizer(obj)
            elif isinstance(obj, DataLoader):
                prepared[i] = self.prepare_loader(obj)
            elif not isinstance(obj, nn.Module):
                raise TypeError(
                    f"prepare() takes modules, optimizers and DataLoaders, not {type(obj).__name__}"
                )
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Place and wrap ``model`` for the strategy; forward runs under autocast.

        With ``channels_last`` its 4-D weights are stored NHWC (where the
        strategy keeps whole weights) and the prepared loaders convert image
        batches; with ``compile`` the strategy compiles it where it needs to.
        """
        if any(model is m for m in [*self._models, *self._model_inputs]):
            raise UsageError(
                "this model was already prepared: call par.prepare(model) once and keep "
                "using the module it returned"
            )
        if self.config.planned and not self._models:
            self._choose_strategy(model)
        # Every replica (and every shard's source) must start from rank 0's
        # weights, whatever each rank's seed did to the model built after it.
        broadcast_module_state(model, device=self.device, timeout_s=self.timeout_s)
        if self._use_channels_last(model):
            self._channels_last = True
            if self.strategy.channels_last_weights:
                to_channels_last(model)  # in place: the user's module stays the one we hold
        # Before wrapping and compile: FSDP2 / DDP / compile wrap blocks that checkpoint.
        apply_checkpointing(model, self.config.activation_checkpointing, self.strategy.options)
        self._rebinder.before(model)
        if self.precision.fp8 is not None:  # after before(): it may replace weights
            self.print(self.precision.fp8.convert(model, self.strategy))
        wrapped = self.strategy.setup_module(model)
        self._rebinder.after(self.strategy.unwrap(wrapped))
        self.precision.wrap_forward(wrapped)
        self.strategy.set_grad_sync(wrapped, self._accumulator.next_is_boundary)
        if self._steps is not None:
            clock = self._steps.clock
            clock.attach(abilities.comm_probe(self.strategy, wrapped, clock.probe_every))
        compile_options = self.config.compile_options
        if compile_options is not None:
            check_compiler(self.device)
            self.strategy.compile_module(wrapped, compile_options)
        self._models.append(wrapped)
        self._model_inputs.append(model)
        return wrapped

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Wrap ``optimizer`` so it steps once per accumulation cycle."""
        if (
            isinstance(optimizer, PreparedOptimizer)
            or any(optimizer is o.optimizer or optimizer is o for o in self._optimizers)
            or any(optimizer is o for o in self._optimizer_inputs)
        ):
            raise UsageError(
                "this optimizer was already prepared: call par.prepare(optimizer) once and "
                "keep using the optimizer it returned"
            )
        self._optimizer_inputs.append(optimizer)
        self._rebinder.rebind(optimizer)  # built before a strategy replaced the parameters
        if fused_step_applies(optimizer, param_device_types(optimizer)):
            use_fused_step(optimizer)  # before the strategy: ZeRO-1 rebuilds from its defaults
        inner = self.strategy.setup_optimizer(optimizer)
        if self.precision.fp8 is not None:
            self.precision.fp8.watch(inner)
        # The first optimizer's steps are the training steps the clock counts.
        tick = self._steps.clock.step if self._steps and not self._optimizers else None
        tick = tick if self._optimizers else self._counting_steps(tick)  # par.profile's steps
        prepared = PreparedOptimizer(inner, self._accumulator, self.precision, on_step=tick)
        self._optimizers.append(prepared)
        return prepared

    def prepare_loader(self, loader: DataLoader, *, train: bool = True) -> PreparedLoader:
        """This rank's share of ``loader`` on this device.

        Training loaders get a ``DistributedSampler`` (shuffle kept, epoch
        advanced per ``iter()``, padded so every rank runs the same number of
        steps); evaluation loaders (``train=False``) see each sample exactly once.
        An ``IterableDataset`` is split while it is read (:mod:`manygpu.core.streams`).
        """
        shard_index, shard_count = self.strategy.data_shard()
        hook = self._end_accumulation_cycle if train else None
        # A generator of ours (the user gave none) is re-seeded per epoch; ranks
        # reading the same shard (tensor/pipeline peers) get the same one.
        seed = (
            None
            if loader.generator is not None
            else ((self.config.seed or 0) * 1_000_003 + shard_index * 10_007)
        )
        extras: dict[str, Any] = dict(
            on_last_batch=hook,
            generator_seed=seed,
            channels_last=lambda: self._channels_last,
            on_wait=self._steps.clock.waited_for_input if self._steps and train else None,
        )
        if isinstance(loader.dataset, IterableDataset):  # a stream: core/streams.py
            stream = prepare_stream(
                loader,
                rank=shard_index,
                world=shard_count,
                train=train,
                split_batches=self.config.split_batches,
                device=self.device,
                timeout_s=self.timeout_s,
                **extras,
            )
            return self._metered(stream, train)
        rebuilt = rebuild_loader(
            loader,
            rank=shard_index,
            world=shard_count,
            train=train,
            seed=self.config.seed or 0,
            split_batches=self.config.split_batches,
            pin_memory=self.device.type == "cuda",
        )
        return self._metered(PreparedLoader(rebuilt, self.device, **extras), train)

    # -- the training step -----------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward with loss scaling and accumulation; gradients sync on the last micro-step."""
        if self.config.grad_accum_steps > 1:
            loss = loss / self.config.grad_accum_steps
        try:
            self.strategy.backward(self.precision.scale(loss))
        except RuntimeError as exc:
            self._raise_if_peer_failure(exc, "gradient all-reduce in backward")
            raise
        if self._accumulator.advance():
            self._reweight_short_cycle()
        self._set_grad_sync(self._accumulator.next_is_boundary)

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | nn.Module,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip by the whole model's (unscaled) gradient norm, which is returned.

        The norm is the model's, not this rank's part of it: shards (FSDP,
        tensor parallel) and pipeline stages contribute their pieces, so every
        strategy clips exactly as one process would. Returns a plain tensor on
        :attr:`device`. Call only when :attr:`sync_gradients` is True.
        """
        params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
        if self.sync_gradients:
            combined = abilities.combined_clip(self.strategy, params, max_norm, norm_type)
            if combined is not None:  # clipped where the gradients are combined
                return combined
        if not self.sync_gradients:
            # Mid-accumulation the gradients are partial (and scaled): clipping or
            # unscaling them now would corrupt the sum still being accumulated.
            warn_user(
                "clip_grad_norm_ called on a micro-step that does not step the optimizer; "
                "call it only when par.sync_gradients is True (skipped)"
            )
            return torch.zeros((), device=self.device)
        owned = {id(p) for p in params}
        for opt in self._optimizers:
            if any(id(p) in owned for g in opt.param_groups for p in g["params"]):
                self.precision.unscale(opt.optimizer)
        try:
            norm = total_grad_norm(
                params,
                norm_type,
                device=self.device,
                across=abilities.grad_norm_group(self.strategy),
                timeout_s=self.timeout_s,
            )
        except RuntimeError as exc:
            self._raise_if_peer_failure(exc, "gradient-norm all-reduce in clip_grad_norm_")
            raise
        clip_grads_(params, max_norm, norm)
        return norm

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast for code outside the prepared model's forward (e.g. the loss)."""
        with self.precision.autocast():
            yield

    # -- utilities -------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper."""
        return self.strategy.unwrap(model)

    def checkpoint_parts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> Parts:
        """What a checkpoint of the prepared ``model`` and ``optimizer`` saves and loads.

        The checkpointer asks this one question instead of reaching into the
        strategy (format, unwrapping, optimizer consolidation), the precision
        plugin (the grad scaler) and the config (the seed).
        """
        # Imported here: `import manygpu` must not pay for the checkpoint package.
        from manygpu.checkpoint_io.formats import Parts, as_format

        inner = optimizer.optimizer if isinstance(optimizer, PreparedOptimizer) else optimizer
        return Parts(
            format=as_format(self.strategy.checkpoint_format),
            model=self.unwrap(model),
            wrapped=model,
            optimizer=inner,
            scaler=self.precision.scaler,
            consolidate=functools.partial(abilities.consolidate, self.strategy),
            seed=self.config.seed,
            strategy=self.strategy_name,
            precision=self.precision_choice.precision,
        )

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Print on the main process only."""
        self.console.print(*objects, **kwargs)

    def progress(self, items: Iterable[T], description: str = "") -> Iterator[T]:
        """A progress bar over ``items`` on the main process (with the strategy's status)."""
        for item in self.console.progress(items, description):
            yield item
            note = abilities.status(self.strategy)
            if note is not None:
                self.console.set_note(note)
        if self._steps is not None and (table := self._steps.new_table()):
            self.print(straggler_board.render(table))

    @property
    def step_times(self) -> list[dict[str, Any]]:
        """Every rank's latest step split (ms: step, input, compute, exposed comm, link), on
        the main rank once a report is complete (what straggler verdicts judge); else empty."""
        return self._steps.table() if self._steps is not None else []

    def seed_everything(self, seed: int) -> None:
        """Seed python, numpy and torch with ``seed`` + this rank's data-shard index.

        Ranks reading different data draw different noise; ranks that share a
        shard (tensor-parallel peers) draw the same dropout masks, which their
        replicated activations need.
        """
        value = seed + self.strategy.data_shard()[0]
        random.seed(value)
        import numpy as np  # imported here: not every job needs it loaded

        np.random.seed(value % 2**32)
        torch.manual_seed(value)

    def close(self) -> None:
        """Tear down the strategy and the process group we created.

        In debug mode every rank first checks that all made the same number
        of collectives: a skipped or extra one is named instead of passing.
        """
        if self._steps is not None:
            self._steps.close()
        self._close_profile()
        self._close_tracking()
        if self.world_size > 1 and comm.common.active() and debug_requested(self.config.debug):
            check_end(timeout_s=self.timeout_s)
        abilities.release(self.strategy)
        self._restore_tf32()
        teardown(self._ctx)

    def __enter__(self) -> Parallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Parallel(strategy={self.strategy_name!r}, "
            f"precision={self.precision_choice.precision!r}, "
            f"rank={self.rank}/{self.world_size}, device={self.device})"
        )

    # -- internals -------------------------------------------------------------
    def _choose_strategy(self, model: nn.Module) -> None:
        """``strategy="auto"``: ask the planner now that the model is known."""
        name = choose_strategy(
            model,
            world=self.world_size,
            local_world=self.cluster.local_world_size,
            device=self.device,
            precision=planned_precision(self.precision_choice.precision),
            batch=self._auto_batch,
            timeout_s=self.timeout_s,
        )
        if name != self.strategy_name:
            # The chosen strategy's own checks and group needs, not the provisional one's.
            options = self.config.strategy_object(name)
            chosen = options.implementation()
            job = self.config.job_options(self.precision_choice.precision)
            chosen.validate_world(self.cluster, options, job)
            chosen.validate_features(options, job)
            if chosen.needs_process_group and not self._ctx.owns_group and self.world_size == 1:
                self._ctx = init_distributed(
                    self.cluster, device=self.device, backend=self._ctx.backend,
                    timeout_s=self.timeout_s, force=True,
                )  # fmt: skip
            self.strategy = chosen(self._ctx, options, job)
            self.strategy_name = name
        self.print(f"manygpu: strategy='auto' chose {name!r}")

    def _step_reports(self, environ: envmod.Environ) -> straggler_board.StepReports | None:
        """This rank's straggler reports (``None``: off, or one process)."""
        return straggler_board.start(
            straggler_board.steps_every(self.config.stragglers, environ),
            self.rank,
            self.world_size,
            local_rank=self.local_rank,
            peers=abilities.timing_peers(self.strategy),
            is_main=self.is_main,
        )

    def _device(
        self, strategy_cls: type[Strategy[Any]], options: StrategySpec, environ: envmod.Environ
    ) -> torch.device:
        """This rank's device: the strategy's slot among this node's GPUs (none: the CPU)."""
        slot = abilities.device_slot(strategy_cls, self.cluster, options)
        if slot is None:
            return torch.device("cpu")
        return choose_device(slot, self.config.device, envmod.gpus_bound_per_task(environ))

    def _bind_device(self, device: torch.device, environ: envmod.Environ) -> None:
        """This process's GPU, or its share of the CPU's threads."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            set_cpu_threads(self.cluster.local_world_size, environ)

    def _use_channels_last(self, model: nn.Module) -> bool:
        """Whether ``model`` runs channels_last: the config's choice, or automatic."""
        return wants_channels_last(
            self.config.channels_last,
            has_conv=has_conv2d(model),
            device_type=self.device.type,
            allowed=self.strategy.channels_last_refusal is None,
        )

    def _set_grad_sync(self, enabled: bool) -> None:
        for model in self._models:
            self.strategy.set_grad_sync(model, enabled)

    def _reweight_short_cycle(self) -> None:
        """Make a cycle cut short (the epoch's last batches) a mean over its own micro-batches.

        Each micro-batch's loss was divided by ``grad_accum_steps`` before its
        backward; a cycle of only k micro-batches would then weigh its batches
        k/steps as much as a full one (a lone last micro-batch would count half
        at steps=2). Scaling the summed gradients by steps/k is the mean over
        what the cycle really had, as one process would compute on those batches.
        """
        steps, had = self.config.grad_accum_steps, self._accumulator.last_cycle
        if had >= steps:
            return
        factor = steps / had
        with torch.no_grad():
            for model in self._models:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(factor)

    def _end_accumulation_cycle(self) -> None:
        self._accumulator.force_boundary()
        self._set_grad_sync(True)

    def _raise_if_peer_failure(self, exc: RuntimeError, operation: str) -> None:
        if isinstance(exc, CollectiveTimeoutError):  # named already: keep the backend's words
            raise exc
        text = str(exc).lower()
        if self.world_size > 1 and any(hint in text for hint in _PEER_FAILURE_HINTS):
            detail = first_line(exc)
            raise CollectiveTimeoutError(self.rank, operation, self.timeout_s, detail) from exc
