"""``"ps"``: parameter servers, synchronous or asynchronous (TensorFlow's ParameterServerStrategy).

The first ``PS.servers`` ranks (or ``manygpu launch --ps K``) are
servers; the rest are workers. The user's script runs unchanged on both:

- a worker's ``prepare`` returns the model on its device, its share of the
  data and a :class:`~.client.PSOptimizer` whose ``step()`` pushes the
  gradients and pulls the parameters. Workers form the job's process group
  on their own: ``par.rank`` / ``par.world_size`` count workers and the first
  worker is the main process that prints and saves checkpoints.
- a server's ``prepare`` never returns into the loop: when the optimizer is
  prepared it builds the user's optimizer class (its defaults and each param
  group's settings) over its shard, serves until every worker has finished,
  and then leaves with :class:`~.server.ServingDone`, a ``SystemExit(0)``,
  like TensorFlow's ``server.join()``. Code after ``prepare`` (the loop,
  evaluation, saving) therefore runs on the workers only, which is where it
  belongs; code before it runs on every rank (servers among themselves).

Gradient clipping: ``par.clip_grad_norm_`` in sync mode clips the *averaged*
gradient on the servers by the whole model's norm (summed over the servers),
as one process clips its global batch's gradient; in async mode each update
is one worker's gradient, clipped by that worker as one process would.
"""

from __future__ import annotations

import atexit
import contextlib
from typing import Any

import torch
from torch import nn

from manygpu.errors import UsageError
from manygpu.runtime.cluster import ClusterInfo
from manygpu.runtime.process_group import DistContext
from manygpu.strategies.base import JobOptions, Strategy
from manygpu.strategies.ddp.zero import _constructor_keys
from manygpu.strategies.ps import PS
from manygpu.strategies.ps.client import PSClient, PSOptimizer, PSStats
from manygpu.strategies.ps.links import PSContext, join
from manygpu.strategies.ps.protocol import HyperLayout, balance
from manygpu.strategies.ps.server import ServingDone, ShardServer
from manygpu.transforms.materialize import Place


class ParameterServerStrategy(Strategy[PS]):
    """Servers hold the parameters and optimizer state; workers push and pull."""

    spec_class = PS

    needs_process_group = True
    shards_data = True
    refused_precisions = frozenset({"fp16"})
    precision_refusal = (
        "fp16's loss scaler skips the steps whose gradients overflow, and a worker that "
        "skips its push stalls the servers' sync step; use precision='bf16' or 'fp32'"
    )

    def __init__(self, ctx: DistContext, options: PS, job: JobOptions) -> None:
        super().__init__(ctx, options, job)
        if not isinstance(ctx, PSContext):
            raise UsageError("strategy 'ps' needs its own process groups: create it via Parallel")
        self.ps: PSContext = ctx
        self.is_server = ctx.role == "server"
        self._module: nn.Module | None = None
        self._client: PSClient | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def validate_world(cls, cluster: ClusterInfo, options: PS, job: JobOptions) -> None:
        servers = _servers(options)
        if job.mesh is not None:
            raise UsageError("strategy 'ps' takes no mesh; give PS(servers=...)")
        if cluster.world_size <= servers:
            raise UsageError(
                f"strategy 'ps' with {servers} server(s) needs at least {servers + 1} "
                f"processes (one worker); this job has {cluster.world_size}: launch more, "
                f"e.g. manygpu launch --ps {servers} --nproc-per-node {servers + 2} script.py"
            )

    @classmethod
    def device_slot(cls, cluster: ClusterInfo, options: PS) -> int | None:
        """Servers use no GPU; a node's workers take its GPUs from the first one."""
        servers_here = servers_on_node(cluster, _servers(options))
        if cluster.local_rank < servers_here:
            return None
        return cluster.local_rank - servers_here

    @classmethod
    def join(
        cls,
        cluster: ClusterInfo,
        options: PS,
        job: JobOptions,
        *,
        device: torch.device,
        backend: str,
        timeout_s: float,
    ) -> DistContext:
        """Role groups and links instead of one group over every rank (see :mod:`.links`)."""
        return join(cluster, _servers(options), device=device, backend=backend, timeout_s=timeout_s)

    def data_shard(self) -> tuple[int, int]:
        return (self.ps.index, self.ps.workers) if not self.is_server else (0, 1)

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        if self._module is not None:
            raise UsageError("strategy 'ps' trains one model: prepare a single model")
        self._module = module
        # A server holds the values on the CPU; a worker computes on its device.
        return place(module, torch.device("cpu") if self.is_server else self.ctx.device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """On a worker: the pushing optimizer. On a server: serve, then exit cleanly."""
        if self._module is None:
            raise UsageError("strategy 'ps': prepare the model before (or with) its optimizer")
        if self._client is not None:
            raise UsageError("strategy 'ps' trains with one optimizer: prepare a single one")
        params = _checked_params(optimizer, self.ps.servers)
        shards = balance([p.numel() for p in params], self.ps.servers)
        hypers = HyperLayout.of(optimizer.param_groups)
        if self.is_server:
            server = _build_server(self.ps, optimizer, params, shards[self.ps.index], hypers,
                                   self.options)  # fmt: skip
            raise ServingDone(server.serve())
        self._client = PSClient(self.ps, params=params, shards=shards, hypers=hypers,
                                mode=self.options.mode)  # fmt: skip
        self._optimizer = optimizer
        if self.ps.index == 0:
            self._client.send_init()
        atexit.register(self._bye_quietly)
        return PSOptimizer(optimizer, self._client, main=self.ps.index == 0)

    def combined_clip(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        """Sync: the servers clip the averaged gradient; async: each worker clips its own."""
        if self.options.mode == "async" or self._client is None or self._optimizer is None:
            return None
        given = {id(p) for p in parameters}
        if any(id(p) not in given for p in self._client.params):
            raise UsageError(
                "strategy 'ps' (sync) clips on the servers, by the norm of every parameter "
                "of the optimizer: pass them all, e.g. par.clip_grad_norm_(model, max_norm)"
            )
        norm = self._client.push(self._optimizer.param_groups, clip=(max_norm, norm_type))
        return torch.tensor(norm, device=self.ctx.device)

    def consolidate_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # The main worker writes the checkpoint: it fetches the servers' state.
        if self.ps.index == 0 and isinstance(optimizer, PSOptimizer):
            optimizer.consolidate()

    @property
    def stats(self) -> PSStats | None:
        """What the servers last reported to this worker (``None`` on servers)."""
        return self._client.stats if self._client is not None else None

    def status(self) -> str | None:
        return self._client.stats.line() if self._client is not None else None

    def teardown(self) -> None:
        if self._client is not None:
            atexit.unregister(self._bye_quietly)
            self._bye_quietly()

    def _bye_quietly(self) -> None:
        """Say goodbye, or the servers would take this worker's exit for a crash.

        Quietly: a server that cannot hear it any more has failed already, and
        that failure (or the one it caused here) is what the job reports.
        """
        with contextlib.suppress(Exception):
            if self._client is not None:
                self._client.bye()


def servers_on_node(cluster: ClusterInfo, servers: int) -> int:
    """How many of the job's first ``servers`` ranks run on this node.

    A node's processes hold consecutive global ranks (as torchrun numbers
    them), from ``rank - local_rank`` on.
    """
    first = cluster.rank - cluster.local_rank
    return max(0, min(servers - first, cluster.local_world_size))


def _servers(options: PS) -> int:
    return options.servers if options.servers is not None else 1


def _checked_params(optimizer: torch.optim.Optimizer, servers: int) -> list[torch.Tensor]:
    """The optimizer's parameters in its own order (its state_dict's), checked."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) < servers:
        raise UsageError(
            f"strategy 'ps': {servers} servers for {len(params)} parameter tensors leaves a "
            "server without any; use fewer servers"
        )
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not params[0].is_floating_point():
        raise UsageError(
            f"strategy 'ps' sends parameters of one floating dtype, this optimizer has "
            f"{sorted(str(d) for d in dtypes)}: keep the model in one dtype (precision= "
            "handles mixed precision)"
        )
    return params


def _build_server(
    ctx: PSContext,
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    indices: tuple[int, ...],
    hypers: HyperLayout,
    options: PS,
) -> ShardServer:
    """This server's shard (CPU copies) and the user's optimizer class built over it."""
    mine = set(indices)
    shard: list[torch.Tensor] = []
    spec: list[dict[str, Any]] = []
    of_group: dict[int, int] = {}
    at = 0
    for gi, group in enumerate(optimizer.param_groups):
        owned = []
        for p in group["params"]:
            if at in mine:
                owned.append(p.detach().to("cpu", copy=True))
            at += 1
        if owned:
            of_group[gi] = len(spec)
            spec.append({**{k: v for k, v in group.items() if k != "params"}, "params": owned})
            shard += owned
    cls = type(optimizer)
    accepted = _constructor_keys(cls)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    built = cls(spec, **defaults)
    groups = {gi: built.param_groups[j] for gi, j in of_group.items()}
    return ShardServer(ctx, params=shard, optimizer=built, groups=groups, hypers=hypers,
                       indices=indices, options=options)  # fmt: skip
