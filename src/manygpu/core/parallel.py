"""The one object a training script talks to.

``Parallel`` knows which process this is, owns the process group, and prepares
model, optimizer and data for the chosen strategy. It is a facade over parts
that each get what they need when built: the strategy (:mod:`.build`), the
step event every per-step feature listens to (:mod:`.steps`), the model
transforms in their one order (:mod:`manygpu.transforms.pipeline`), the
collectives (:mod:`.job_comm`), logging and profiling
(:mod:`manygpu.observe`), and the job's checkpointed state (:mod:`.job_state`).
It never branches on the strategy's name: the strategy object does the
strategy-specific work.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from manygpu import comm
from manygpu.comm.common import debug_requested, raise_peer_failure
from manygpu.comm.debug import check_end
from manygpu.core import build
from manygpu.core.accumulation import reweight_short_cycle
from manygpu.core.assembly import Current, JobFacts, assemble
from manygpu.core.auto import choose_strategy
from manygpu.core.clipping import clip_grad_norm
from manygpu.core.config import ParallelConfig
from manygpu.core.data import PreparedLoader
from manygpu.core.optimizer import PreparedOptimizer
from manygpu.core.precision import PrecisionPlugin, announcement, apply_tf32
from manygpu.core.token_weights import TokenWeights
from manygpu.errors import UsageError
from manygpu.observe import straggler_board
from manygpu.observe.profiling import ProfileWindow
from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import ClusterInfo, detect_cluster
from manygpu.runtime.process_group import teardown
from manygpu.strategies import Strategy, abilities
from manygpu.transforms.fp8 import planned_precision
from manygpu.transforms.materialize import empty_init
from manygpu.weights import save_weights

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


T = TypeVar("T")


class Parallel:
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
        started = build.started(config, cluster or detect_cluster(environ), environ)
        self.precision_choice = started.choice
        """What ``precision=`` became on this device (``"auto"`` resolved)."""
        self.timeout_s, self._ctx, self._device_name = (
            started.timeout_s,
            started.ctx,
            started.device_name,
        )
        # The job as this rank's role sees it: a parameter-server job's workers
        # count workers only (the servers never run the loop).
        self.cluster = self._ctx.cluster
        self._current = Current(started.chosen.name, started.strategy)
        device = self._ctx.device
        self.precision = PrecisionPlugin.chosen(self.precision_choice, device)
        self._restore_tf32 = apply_tf32(self.precision_choice)
        self._auto_batch = 32  # per-device batch the planner assumes for "auto"
        facts = JobFacts(config, self.cluster, self.is_main, device, self.timeout_s,
                    self.precision, self.precision_choice)  # fmt: skip
        parts = assemble(self._current, facts, environ)
        self._accumulator, self._reports, self._prep = parts.accumulator, parts.reports, parts.prep
        self._tokens = TokenWeights(self.timeout_s, device)
        self.console, self.collectives = parts.console, parts.collectives
        self.job_log, self.profiler = parts.job_log, parts.profiler
        self.events = parts.events
        """The job's optimizer steps and what runs at each (:mod:`manygpu.core.steps`)."""
        self.job_state = parts.job_state
        """What a ``Checkpointer`` saves and restores of the job (:mod:`.job_state`)."""
        if (said := announcement(self.precision_choice, self._device_name)) is not None:
            self.print(said)
        if config.seed is not None:
            self.seed_everything(config.seed)

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
    def strategy(self) -> Strategy[Any]:
        """The strategy object doing the work (``"auto"``: decided at the first model)."""
        return self._current.strategy

    @property
    def strategy_name(self) -> str:
        """The strategy's registry name, e.g. ``"ddp"``."""
        return self._current.name

    @property
    def sync_gradients(self) -> bool:
        """Whether the last ``backward`` ended an accumulation cycle (the optimizer steps)."""
        return self._accumulator.last_synced

    # -- preparation -----------------------------------------------------------
    def init_module(self) -> AbstractContextManager[None]:
        """``with par.init_module(): model = Net()``: parameters on the meta device, no
        memory or init until :meth:`prepare` shards, allocates this rank's part and fills
        it (:mod:`manygpu.transforms.materialize`)."""
        return empty_init()

    def prepare(self, *objects: Any, weights: str | os.PathLike[str] | None = None,
                weights_options: dict[str, Any] | None = None) -> Any:  # fmt: skip
        """Prepare models, optimizers and training loaders; returns them in the same order.

        Models first whatever the order given: wrapping may move parameters. Evaluation
        loaders go to :meth:`prepare_loader`. ``weights``: a safetensors file, HF directory or
        checkpoint read into the shards, also at a URL (``weights_options``: fsspec options)."""
        if weights is not None and sum(isinstance(o, nn.Module) for o in objects) != 1:
            raise UsageError("weights= loads one model; give prepare() exactly one")
        prepared: list[Any] = list(objects)
        loaders = [o for o in objects if isinstance(o, DataLoader) and o.batch_size]
        self._auto_batch = int(loaders[0].batch_size or 1) if loaders else self._auto_batch
        for i, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                prepared[i] = self.prepare_model(obj, weights=weights,
                                                 weights_options=weights_options)  # fmt: skip
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

    def prepare_model(self, model: nn.Module, *, weights: str | os.PathLike[str] | None = None,
                      weights_options: dict[str, Any] | None = None) -> nn.Module:  # fmt: skip
        """Place and wrap ``model`` for the strategy; forward runs under autocast.

        The steps and their order: :mod:`manygpu.transforms.pipeline`. With
        ``channels_last`` its 4-D weights are stored NHWC (where the strategy
        keeps whole weights) and the prepared loaders convert image batches;
        with ``compile`` the strategy compiles it where it needs to.
        """
        self._prep.refuse_again(model)
        if self.config.planned and not self._prep.models:
            self._choose_strategy(model)
        return self._prep.model(model, weights, weights_options)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Wrap ``optimizer`` so it steps once per accumulation cycle."""
        return self._prep.optimizer(optimizer)

    def prepare_loader(self, loader: DataLoader, *, train: bool = True) -> PreparedLoader:
        """This rank's share of ``loader`` on this device.

        Training loaders get a ``DistributedSampler`` (shuffle kept, epoch
        advanced per ``iter()``, padded so every rank runs the same number of
        steps); evaluation loaders (``train=False``) see each sample exactly once.
        An ``IterableDataset`` is split while it is read (:mod:`manygpu.core.streams`).
        """
        return self._prep.loader(loader, train=train)

    # -- the training step -----------------------------------------------------
    def backward(self, loss: torch.Tensor, *, tokens: int | torch.Tensor | None = None) -> None:
        """Backward, scaled and accumulated (``tokens``: :mod:`manygpu.core.token_weights`)."""
        self._tokens.note(loss, tokens, self.strategy)
        if self.config.grad_accum_steps > 1 and tokens is None:
            loss = loss / self.config.grad_accum_steps
        try:
            self.strategy.backward(self.precision.scale(loss))
        except RuntimeError as exc:
            raise_peer_failure(
                exc, rank=self.rank, world_size=self.world_size, timeout_s=self.timeout_s,
                operation="gradient all-reduce in backward",
            )  # fmt: skip
            raise
        models, data_world = self._prep.models, self.strategy.data_shard()[1]
        if self._accumulator.advance() and not self._tokens.end_cycle(models, data_world):
            reweight_short_cycle(models, self.config.grad_accum_steps, self._accumulator.last_cycle)
        self._prep.set_grad_sync(self._accumulator.next_is_boundary)

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | nn.Module,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip by the whole model's (unscaled) gradient norm, which is returned.

        The norm is the model's, not this rank's part of it (:mod:`.clipping`),
        so every strategy clips exactly as one process would. Returns a plain
        tensor on :attr:`device`. Call only when :attr:`sync_gradients` is True.
        """
        params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
        return clip_grad_norm(
            self.strategy, params, max_norm, norm_type, synced=self.sync_gradients,
            optimizers=self._prep.optimizers, precision=self.precision, device=self.device,
            timeout_s=self.timeout_s, rank=self.rank, world_size=self.world_size,
        )  # fmt: skip

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast for code outside the prepared model's forward (e.g. the loss)."""
        with self.precision.autocast():
            yield

    # -- the job's collectives, logging and profiling (their parts' own docs) --
    @property
    def mesh(self) -> DeviceMesh:
        """The job's named device mesh (:meth:`JobCollectives.mesh`): ``par.mesh["tp"]``."""
        return self.collectives.mesh

    def reduce(
        self, tensor: torch.Tensor, op: comm.ReduceOp = "mean", *, over: str | None = None
    ) -> torch.Tensor:
        """A new tensor: ``tensor`` reduced over every rank, or over one mesh dimension.

        ``op`` is ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``; ``over="tp"`` reduces
        among the ranks that differ only in that dimension of :attr:`mesh`.
        """
        return self.collectives.reduce(tensor, op, over=over)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0, in rank order."""
        return self.collectives.gather(tensor)

    def barrier(self) -> None:
        """Wait for every rank (bounded by the timeout; names missing ranks on gloo)."""
        self.collectives.barrier()

    def log(
        self,
        values: Mapping[str, Any],
        *,
        step: int | None = None,
        reduce: Mapping[str, str] | None = None,
    ) -> dict[str, float]:
        """Reduce ``values`` over every rank and log them at ``step`` (collective;
        :meth:`manygpu.observe.job_log.JobLog.log`)."""
        return self.job_log.log(values, step=step, reduce=reduce)

    def profile(self, steps: range, *, dir: str | Path | None = None) -> ProfileWindow:
        """torch.profiler on every rank for training ``steps`` only
        (:meth:`manygpu.observe.profiling.Profiler.profile`)."""
        return self.profiler.profile(steps, dir=dir)

    # -- utilities -------------------------------------------------------------
    def save_weights(self, model: nn.Module, path: str | os.PathLike[str], **kw: Any) -> Any:
        """``model``'s weights as safetensors from its shards, one tensor gathered at a time
        (every rank calls it): :func:`manygpu.weights.save_weights`'s keywords."""
        return save_weights(self.unwrap(model), path, **{"timeout_s": self.timeout_s, **kw})

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper."""
        return self.strategy.unwrap(model)

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
        if self._reports is not None and (table := self._reports.new_table()):
            self.print(straggler_board.render(table))

    @property
    def step_times(self) -> list[dict[str, Any]]:
        """Every rank's latest step split (ms: step, input, compute, exposed comm, link), on
        the main rank once a report is complete (what straggler verdicts judge); else empty."""
        return self._reports.table() if self._reports is not None else []

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
        if self._reports is not None:
            self._reports.close()
        self.profiler.close()
        self.job_log.close()
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
            model, world=self.world_size, local_world=self.cluster.local_world_size,
            device=self.device, precision=planned_precision(self.precision_choice.precision),
            batch=self._auto_batch, timeout_s=self.timeout_s,
        )  # fmt: skip
        if name != self.strategy_name:
            self._ctx, strategy = build.rebuilt(
                name, self.config, self._ctx, self.precision_choice.precision, self.timeout_s
            )
            self._current.name, self._current.strategy = name, strategy
        self.print(f"manygpu: strategy='auto' chose {name!r}")
