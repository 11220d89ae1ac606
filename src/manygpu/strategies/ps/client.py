"""A worker's side: push gradients, pull parameters, and the optimizer the loop steps.

:class:`PSOptimizer` stands where the user's optimizer stood. Its ``step()``
sends each server its shard's gradients with every number of every param
group (so LR schedulers keep working: they change the user's param groups,
which this optimizer shows as its own) and copies the parameters the servers
send back into the model. The user's optimizer object holds no state on a
worker: the servers hold it, built from its class, defaults and groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from manygpu.errors import UsageError
from manygpu.strategies.optimizer_view import OptimizerView
from manygpu.strategies.ps.links import Link, PSContext
from manygpu.strategies.ps.protocol import (
    BYE,
    FETCH,
    INIT,
    LOAD,
    PUSH,
    STEP,
    HyperLayout,
    Layout,
    ParameterServerError,
    Reply,
    count,
    fill_request,
    flatten,
    from_bytes,
    shown,
    state_limit,
    to_bytes,
    unflatten_into,
)


@dataclass
class PSStats:
    """What this worker last heard from the servers (its progress line reads it)."""

    mode: str
    updates: list[int] = field(default_factory=list)
    """Updates each server has applied."""
    lags: list[int] = field(default_factory=list)
    """Each worker's lag as the first server last reported it (-1: gone)."""
    my_lags: list[int] = field(default_factory=list)
    """This worker's lag at the start of each of its steps after the first."""
    taus: list[int] = field(default_factory=list)
    """Per step of this worker: updates applied between its pull and its push (first server)."""
    live: int = 0

    def line(self) -> str:
        """One short line: updates per server and, in async mode, each worker's lag."""
        head = f"ps {self.mode}: updates {'/'.join(str(u) for u in self.updates)}"
        if self.mode == "sync":
            return head
        lags = " ".join("gone" if lag < 0 else str(lag) for lag in self.lags)
        return f"{head}, staleness per worker {lags}"


@dataclass(frozen=True)
class _Server:
    """What a worker keeps per server: its link, its parameters and its message buffers."""

    rank: int
    link: Link
    indices: tuple[int, ...]
    layout: Layout
    header: torch.Tensor
    reply: torch.Tensor
    values: torch.Tensor
    """Receives the shard's parameters."""


class PSClient:
    """One worker's connection to every server."""

    def __init__(
        self,
        ctx: PSContext,
        *,
        params: list[torch.Tensor],
        shards: list[tuple[int, ...]],
        hypers: HyperLayout,
        mode: str,
    ) -> None:
        self.ctx, self.params, self.hypers = ctx, params, hypers
        self.dtype = params[0].dtype
        self.timeout_s = ctx.timeout_s
        self.stats = PSStats(mode=mode, updates=[0] * ctx.servers)
        self.servers = []
        for s, indices in enumerate(shards):
            layout = Layout(hypers, len(indices), ctx.workers)
            numel = sum(params[i].numel() for i in indices)
            self.servers.append(
                _Server(s, ctx.links[s], indices, layout, layout.new_request(),
                        layout.new_reply(), torch.zeros(numel, dtype=self.dtype))
            )  # fmt: skip
        self.steps = 0
        self.pending_step = False
        """A clipped push is waiting for its ``step()``."""
        self.said_bye = False

    def _shard(self, server: _Server) -> list[torch.Tensor]:
        return [self.params[i] for i in server.indices]

    def send_init(self) -> None:
        """The first worker hands each server its shard's initial values (before any push)."""
        for server in self.servers:
            values = flatten(self._shard(server), self.dtype)
            fill_request(server.header, INIT, step=values.numel())
            server.link.exchange([server.header, values], [], "sending the initial parameters",
                                 self.timeout_s)  # fmt: skip

    def push(self, groups: list[dict[str, Any]], clip: tuple[float, float] | None = None) -> float:
        """Send each server its gradients; pull the new parameters (when clipping: the norm)."""
        hypers = self.hypers.pack(groups)
        works = []
        for server in self.servers:
            shard = self._shard(server)
            grads = [p.grad for p in shard]
            filled = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shard]
            flat = flatten(filled, self.dtype)
            present = [g is not None for g in grads]
            fill_request(
                server.header, PUSH, step=self.steps, clip=clip, hypers=hypers, present=present
            )
            recvs = [server.reply] if clip is not None else [server.reply, server.values]
            works.append((server, self._post(server, [server.header, flat], recvs)))
        norm = self._finish(works, "pushing gradients", pulled=clip is None)
        self.pending_step = clip is not None
        return norm

    def finish_step(self, groups: list[dict[str, Any]]) -> None:
        """After a clipped push: tell the servers to apply it; pull the new parameters."""
        hypers = self.hypers.pack(groups)
        works = []
        for server in self.servers:
            fill_request(server.header, STEP, step=self.steps, hypers=hypers)
            works.append((server, self._post(server, [server.header],
                                             [server.reply, server.values])))  # fmt: skip
        self._finish(works, "stepping", pulled=True)
        self.pending_step = False

    def _post(self, server: _Server, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list:
        return [server.link.send(t) for t in sends] + [server.link.recv(t) for t in recvs]

    def _finish(self, works: list[tuple[_Server, list[Any]]], what: str, *, pulled: bool) -> float:
        """Wait for every server's answer; copy pulled parameters in; keep the stats."""
        for server, posted in works:
            for work in posted:
                server.link.wait(work, what, self.timeout_s)
        replies = [Reply.read(server.reply) for server, _ in works]
        if pulled:
            with torch.no_grad():
                for server, _ in works:
                    unflatten_into(server.values, self._shard(server))
            self.steps += 1
            self._record(replies)
        return replies[0].norm

    def _record(self, replies: list[Reply]) -> None:
        first = replies[0]
        self.stats.updates = [r.version for r in replies]
        self.stats.lags, self.stats.live = list(first.lags), first.live
        self.stats.my_lags.append(first.lag)
        self.stats.taus.append(first.tau)

    def fetch(self) -> tuple[list[torch.Tensor], dict[int, Any]]:
        """Every server's parameters (flat, per server) and optimizer state (by global index)."""
        flats, state = [], {}
        for server in self.servers:
            fill_request(server.header, FETCH)
            server.link.exchange([server.header], [server.reply], "fetching the state",
                                 self.timeout_s)  # fmt: skip
            data = torch.zeros(self._state_size(server), dtype=torch.uint8)
            server.link.exchange([], [data], "fetching the state", self.timeout_s)
            got = from_bytes(data)
            flats.append(got["params"])
            state.update(got["state"])
        return flats, state

    def _state_size(self, server: _Server) -> int:
        """The byte count a FETCH reply announces, bounded as the server bounds a LOAD."""
        shard = self._shard(server)
        limit = state_limit(server.values.numel(), server.values.element_size(), len(shard))
        size = count(float(server.reply[0]), 1, limit)
        if size is None:
            raise ParameterServerError(
                f"rank {server.link.me}: parameter server rank {server.rank} announced a state "
                f"of {shown(float(server.reply[0]))} bytes; its shard allows at most {limit:,}"
            )
        return size

    def load(self, state: dict[int, Any], groups: list[dict[str, Any]]) -> None:
        """Replace every server's shard with this worker's parameters and ``state``; wait."""
        for server in self.servers:
            payload = to_bytes({
                "params": flatten(self._shard(server), self.dtype),
                "state": {i: state[i] for i in server.indices if i in state},
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
            })  # fmt: skip
            fill_request(server.header, LOAD, step=payload.numel())
            what = "loading a checkpoint into the servers"
            server.link.exchange([server.header, payload], [server.reply], what, self.timeout_s)

    def pull_into_model(self, flats: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for server, flat in zip(self.servers, flats, strict=True):
                unflatten_into(flat, self._shard(server))

    def bye(self) -> None:
        """Tell every server this worker is done (once)."""
        if self.said_bye:
            return
        self.said_bye = True
        for server in self.servers:
            fill_request(server.header, BYE)
            server.link.exchange([server.header], [], "saying goodbye", self.timeout_s)


class PSOptimizer(OptimizerView):
    """The user's optimizer on a worker: ``step()`` pushes and pulls; the servers step.

    Subclassing ``Optimizer`` without its ``__init__`` keeps LR schedulers and
    ``isinstance`` checks working; ``param_groups`` are the user's own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, client: PSClient, main: bool) -> None:
        # Deliberately no super().__init__: the servers hold the parameters' state.
        self.optimizer = optimizer
        self.client = client
        self.main = main
        self._fetched: dict[str, Any] | None = None

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Push this worker's gradients and pull the servers' parameters."""
        if closure is not None:
            raise UsageError("closures are not supported by manygpu's prepared optimizer")
        self._fetched = None
        if self.client.pending_step:
            self.client.finish_step(self.param_groups)
        else:
            self.client.push(self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def consolidate(self) -> None:
        """Fetch the servers' state (and their newest parameters, into the model)."""
        flats, state = self.client.fetch()
        self.client.pull_into_model(flats)
        full = self.optimizer.state_dict()
        full["state"] = state
        self._fetched = full

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state in the user's optimizer's own format, from the servers."""
        if self._fetched is None:
            self.consolidate()
        assert self._fetched is not None
        return self._fetched

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Groups here; on the main worker also parameters and state into the servers.

        The model must already hold the checkpoint's parameters (a checkpoint
        loads the model first): the main worker sends them with the state.
        Other workers must not push before it is done: ``Checkpointer.resume``
        ends with a barrier, so they do not.
        """
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._fetched = None
        if self.main:
            self.client.load(state_dict.get("state", {}), self.param_groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UsageError(
            "strategy 'ps' splits the parameters over the servers when the optimizer is "
            "prepared: give every param group to the optimizer before prepare()"
        )

    def __repr__(self) -> str:
        return f"PSOptimizer({self.optimizer!r})"
