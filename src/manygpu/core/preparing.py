"""``prepare``'s three jobs: a model, an optimizer and a loader made ready for the strategy.

One part of :class:`~manygpu.Parallel`, given what it needs when built; the
strategy is asked for on use, since ``strategy="auto"`` decides it at the
first model. The model's steps and their order are
:mod:`manygpu.transforms.pipeline`'s; the optimizer's updates fire the job's
step event (:mod:`.steps`); a training loader's last batch ends the
accumulation cycle, so no gradient is left behind at an epoch's end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from manygpu.core.accumulation import Accumulator
from manygpu.core.config import ParallelConfig
from manygpu.core.data import PreparedLoader, rebuild_loader
from manygpu.core.model_values import ModelValues
from manygpu.core.optimizer import PreparedOptimizer
from manygpu.core.precision import PrecisionPlugin
from manygpu.core.rebind import ParameterRebinder
from manygpu.core.speed import (
    check_compiler,
    fused_step_applies,
    param_device_types,
    use_fused_step,
)
from manygpu.core.steps import StepEvents
from manygpu.core.streams import prepare_stream
from manygpu.errors import UsageError
from manygpu.observe.job_log import JobLog
from manygpu.observe.straggler_board import StepReports
from manygpu.runtime.host_memory import release_host_memory
from manygpu.strategies import Strategy, abilities
from manygpu.transforms.channels_last import ChannelsLast
from manygpu.transforms.checkpointing import CheckpointBlocks
from manygpu.transforms.fp8 import ToFloat8
from manygpu.transforms.materialize import place
from manygpu.transforms.pipeline import Around, ModelTransform, prepare_module
from manygpu.warn import UnpreparedDataWarning, warn_user


class Preparer:
    """The job's prepared models, optimizers and loaders, and what they share."""

    def __init__(
        self, *, strategy: Callable[[], Strategy[Any]], config: ParallelConfig,
        device: torch.device, timeout_s: float, precision: PrecisionPlugin,
        accumulator: Accumulator, events: StepEvents, reports: StepReports | None,
        job_log: JobLog, say: Callable[[str], None], is_main: bool = True,
    ) -> None:  # fmt: skip
        self._strategy, self._config, self._device = strategy, config, device
        self._timeout_s, self._precision, self._accumulator = timeout_s, precision, accumulator
        self._events, self._reports, self._job_log, self._say = events, reports, job_log, say
        self.models: list[nn.Module] = []
        self.optimizers: list[PreparedOptimizer] = []
        self._model_inputs: list[nn.Module] = []  # what users passed: a second prepare is refused
        self._optimizer_inputs: list[torch.optim.Optimizer] = []
        self._rebinder = ParameterRebinder()
        self._channels_last = False  # set when a prepared model runs channels_last
        self._is_main, self._loaders, self._checked_data = is_main, 0, False

    # -- models ----------------------------------------------------------------
    def refuse_again(self, model: nn.Module) -> None:
        """One line when ``model`` (or what ``prepare`` returned for it) comes back."""
        if any(model is m for m in [*self.models, *self._model_inputs]):
            raise UsageError(
                "this model was already prepared: call par.prepare(model) once and keep "
                "using the module it returned"
            )

    def model(
        self,
        model: nn.Module,
        weights: str | os.PathLike[str] | None = None,
        weights_options: dict[str, Any] | None = None,
    ) -> nn.Module:
        """``model`` through the transforms and the strategy, in the pipeline's order."""
        strategy, config = self._strategy(), self._config
        values = ModelValues(
            model, weights=weights, weights_options=weights_options, seed=config.seed or 0,
            device=self._device,
            timeout_s=self._timeout_s, unwrap=strategy.unwrap, say=self._say,
        )  # fmt: skip
        layout = ChannelsLast(
            config.channels_last, device_type=self._device.type,
            allowed=strategy.channels_last_refusal is None,
            weights=strategy.channels_last_weights,
        )  # fmt: skip
        transforms: list[ModelTransform] = [
            layout,
            CheckpointBlocks(config.activation_checkpointing, strategy.options),
        ]
        if self._precision.fp8 is not None:
            transforms.append(ToFloat8(self._precision.fp8, strategy))

        def shard(module: nn.Module) -> nn.Module:
            values.record(module)
            return strategy.setup_module(module, place)

        around = Around(
            # Every replica (and every shard's source) starts from rank 0's weights,
            # whatever each rank's seed did to the model built after it.
            sync_weights=values.sync,
            remember=self._rebinder.before,
            shard=shard,
            fill=values.fill,
            hook=self._hook,
            compile=None if config.compile_options is None else self._compile,
        )
        wrapped = prepare_module(model, transforms, around, self._say)
        release_host_memory()  # what placing and filling freed goes back to the system
        self._channels_last = self._channels_last or layout.chosen
        self.models.append(wrapped)
        self._model_inputs.append(model)
        return wrapped

    def _hook(self, wrapped: nn.Module) -> None:
        """The job's hooks on a wrapped model (step 5 of the transforms' pipeline)."""
        strategy = self._strategy()
        self._rebinder.after(strategy.unwrap(wrapped))
        self._precision.wrap_forward(wrapped)
        strategy.set_grad_sync(wrapped, self._accumulator.next_is_boundary)
        if self._reports is not None:
            clock = self._reports.clock
            clock.attach(abilities.comm_probe(strategy, wrapped, clock.probe_every))

    def _compile(self, wrapped: nn.Module) -> None:
        options = self._config.compile_options
        assert options is not None  # only set as the pipeline's compile step when given
        check_compiler(self._device)
        self._strategy().compile_module(wrapped, options)

    # -- optimizers ------------------------------------------------------------
    def optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Wrap ``optimizer`` so it steps once per accumulation cycle."""
        if (
            isinstance(optimizer, PreparedOptimizer)
            or any(optimizer is o.optimizer or optimizer is o for o in self.optimizers)
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
        inner = self._strategy().setup_optimizer(optimizer)
        # The first optimizer's steps are the job's training steps.
        first = not self.optimizers
        prepared = PreparedOptimizer(
            inner, self._accumulator, self._precision, self._events, first=first
        )
        self.optimizers.append(prepared)
        if first:
            self._events.on_step("data", self._check_data)
        return prepared

    def _check_data(self, step: int) -> None:
        """At the job's first step (once), warn when no loader was prepared and the
        strategy splits data: each rank would read the whole data set, silently."""
        if self._checked_data:
            return
        self._checked_data = True
        why = unprepared_data(self._strategy().data_shard()[1], self._loaders)
        if why is not None and self._is_main:
            warn_user(why, UnpreparedDataWarning)

    # -- loaders ---------------------------------------------------------------
    def loader(self, loader: DataLoader, *, train: bool) -> PreparedLoader:
        """This rank's share of ``loader`` on the device (``Parallel.prepare_loader``)."""
        self._loaders += 1
        shard_index, shard_count = self._strategy().data_shard()
        config = self._config
        # A generator of ours (the user gave none) is re-seeded per epoch; ranks
        # reading the same shard (tensor/pipeline peers) get the same one.
        seed = (
            None
            if loader.generator is not None
            else ((config.seed or 0) * 1_000_003 + shard_index * 10_007)
        )
        reports = self._reports
        extras: dict[str, Any] = dict(
            on_last_batch=self.end_accumulation_cycle if train else None,
            generator_seed=seed,
            channels_last=lambda: self._channels_last,
            on_wait=reports.clock.waited_for_input if reports is not None and train else None,
        )
        if isinstance(loader.dataset, IterableDataset):  # a stream: core/streams.py
            stream = prepare_stream(
                loader, rank=shard_index, world=shard_count, train=train,
                split_batches=config.split_batches, device=self._device,
                timeout_s=self._timeout_s, **extras,
            )  # fmt: skip
            return self._job_log.metered(stream, train)
        rebuilt = rebuild_loader(
            loader, rank=shard_index, world=shard_count, train=train,
            seed=config.seed or 0, split_batches=config.split_batches,
            pin_memory=self._device.type == "cuda",
        )  # fmt: skip
        return self._job_log.metered(PreparedLoader(rebuilt, self._device, **extras), train)

    # -- accumulation ----------------------------------------------------------
    def set_grad_sync(self, enabled: bool) -> None:
        """Whether the coming backward synchronises gradients, on every prepared model."""
        strategy = self._strategy()
        for model in self.models:
            strategy.set_grad_sync(model, enabled)

    def end_accumulation_cycle(self) -> None:
        """The loader's last batch: the coming backward ends the cycle and synchronises."""
        self._accumulator.force_boundary()
        self.set_grad_sync(True)


def unprepared_data(shards: int, loaders: int) -> str | None:
    """The warning for a job's first step, or None: ``shards`` data shards (the
    strategy's split), ``loaders`` loaders prepared so far."""
    if shards <= 1 or loaders:
        return None
    return (
        f"training under a strategy that splits data over {shards} ranks, and no DataLoader "
        "went through par.prepare: each rank reads whatever it was given, the whole data set "
        "unless it chose its own share; pass the loader: model, opt, loader = "
        "par.prepare(model, opt, loader). A job that shards its own data silences this with "
        "warnings.simplefilter('ignore', manygpu.warn.UnpreparedDataWarning)"
    )
