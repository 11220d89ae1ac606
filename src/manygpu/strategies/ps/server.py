"""One parameter server: its shard of the parameters, their optimizer, and a thread per worker.

Each worker has a thread here that receives its messages in order. In
``sync`` mode a *round* collects one push from every live worker, averages
the gradients (in worker order, so the result is the same every run) and
applies the user's optimizer once; every worker then gets the new shard. In
``async`` mode each push is applied at once, under one lock (updates never
interleave), and the worker gets the shard as it is after it, but only when
it may start its next step: with ``max_staleness = S`` a worker that has
finished ``k`` steps waits until every live worker has finished ``k - S``
(the *bounded delay* of Li et al., OSDI 2014, "Scaling distributed machine
learning with the parameter server"). Each update is recorded with its lag
(steps ahead of the slowest worker) and its tau (updates applied between the
worker's pull and its push).

A worker that goes away is dropped in ``async`` mode (one line on stderr);
in ``sync`` mode the server stops with an error naming it, as a step cannot
be completed without it. A worker whose message breaks the protocol (a size
beyond the shard, an unknown kind: see :func:`.protocol.request_problem`)
is treated the same way, with a line saying what it sent. When every worker
has said goodbye the server leaves :meth:`~manygpu.Parallel.prepare` with
:class:`ServingDone`, a clean ``SystemExit(0)``.
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from manygpu.comm.common import first_line
from manygpu.errors import CollectiveTimeoutError
from manygpu.strategies.ps import PS
from manygpu.strategies.ps.links import Link, PSContext, lost, short
from manygpu.strategies.ps.protocol import (
    BYE,
    FETCH,
    GONE,
    INIT,
    PUSH,
    STEP,
    BadMessage,
    HyperLayout,
    Layout,
    ParameterServerError,
    Reply,
    clip_coefficient,
    clip_of,
    count,
    flatten,
    from_bytes,
    request_problem,
    shown,
    state_limit,
    state_problem,
    to_bytes,
    unflatten_into,
)


@dataclass(frozen=True)
class UpdateRecord:
    """One update this server applied."""

    worker: int
    """The worker's index (0 = the first worker)."""
    step: int
    """The worker's own step count for this gradient."""
    lag: int
    """Steps the worker was ahead of the slowest live worker when it started the step."""
    tau: int
    """Updates applied between the worker's pull and this update."""
    version: int
    """Updates applied by this server, this one included."""


@dataclass
class ServeRecord:
    """What a server did, for tests and logs."""

    server: int
    updates: list[UpdateRecord] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    """Workers (global ranks) that said goodbye."""
    dropped: list[int] = field(default_factory=list)
    """Workers (global ranks) that went away (async mode)."""


class ServingDone(SystemExit):
    """Raised out of ``prepare`` on a server when the workers are done: exit code 0."""

    def __init__(self, record: ServeRecord) -> None:
        super().__init__(0)
        self.record = record


class _Stopped(Exception):
    """Unwinds a worker's thread once the server has a fatal error."""


class ShardServer:
    """Holds ``params`` (this server's shard, CPU tensors) and steps ``optimizer`` on them."""

    def __init__(
        self,
        ctx: PSContext,
        *,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        groups: dict[int, dict[str, Any]],
        hypers: HyperLayout,
        indices: tuple[int, ...],
        options: PS,
    ) -> None:
        self.ctx, self.params, self.optimizer, self.groups = ctx, params, optimizer, groups
        self.indices = indices
        """Global indices (optimizer order) of ``params``."""
        self.mode, self.max_staleness = options.mode, options.max_staleness
        self.timeout_s = ctx.timeout_s
        self.workers = sorted(ctx.links)
        self.layout = Layout(hypers, len(params), len(self.workers))
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        self.load_limit = state_limit(self.numel, params[0].element_size(), len(params))
        """The most bytes a worker's state to load may have (checked before allocating)."""
        self.record = ServeRecord(server=ctx.index)
        self._cond = threading.Condition()
        self._live = set(self.workers)
        self._steps = dict.fromkeys(self.workers, 0)
        self._pulled = dict.fromkeys(self.workers, 0)
        self._lag = dict.fromkeys(self.workers, 0)
        self._version = 0
        self._fatal: BaseException | None = None
        self._arrived: dict[int, tuple[float, torch.Tensor, torch.Tensor | None]] = {}
        self._round = 0
        self._norm = 0.0
        self._pending: tuple[torch.Tensor, list[bool]] | None = None

    # -- the loop ---------------------------------------------------------------
    def serve(self) -> ServeRecord:
        """Take the first worker's initial parameters, then serve until every worker is done."""
        self._receive_init()
        threads = [
            threading.Thread(target=self._serve_worker, args=(w,), daemon=True, name=f"ps-{w}")
            for w in self.workers
        ]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads) and self._fatal is None:
            for thread in threads:
                thread.join(0.2)
        if self._fatal is not None:
            raise self._fatal
        if not self.record.finished:
            raise ParameterServerError(
                f"parameter server rank {self.ctx.global_cluster.rank}: every worker went away "
                f"before finishing ({self.record.dropped})"
            )
        return self.record

    def _receive_init(self) -> None:
        """The first worker's parameters; a wrong count ends the job (no worker could train)."""
        link = self.ctx.links[self.workers[0]]
        header, values = self.layout.new_request(), torch.zeros(self.numel, dtype=self.dtype)
        link.wait(link.recv(header), "receiving the initial parameters", self.timeout_s)
        kind, size = float(header[0]), float(header[1])
        if kind != INIT or count(size, self.numel, self.numel) is None:
            what = "initial parameters" if kind == INIT else f"a message of kind {kind!r} with"
            raise ParameterServerError(
                f"parameter server rank {link.me}: worker rank {link.peer} sent {what} of "
                f"{shown(size)} numbers; this server holds {self.numel:,} of its model: build "
                "the same model and optimizer on every rank"
            )
        link.wait(link.recv(values), "receiving the initial parameters", self.timeout_s)
        with torch.no_grad():
            unflatten_into(values, self.params)

    def _serve_worker(self, w: int) -> None:
        """Answer worker ``w`` in order until it says goodbye, goes away, or the server stops."""
        link = self.ctx.links[w]
        header, grad = self.layout.new_request(), torch.zeros(self.numel, dtype=self.dtype)
        reply, out = self.layout.new_reply(), torch.zeros(self.numel, dtype=self.dtype)
        try:
            while True:
                link.wait(link.recv(header), "waiting for a request", self.timeout_s)
                self._check(header)
                kind = float(header[0])
                if kind == BYE:
                    self._leave(w, finished=True)
                    return
                if kind == PUSH:
                    link.wait(link.recv(grad), "receiving a gradient", self.timeout_s)
                    answer, with_params = self._push(w, header, grad, out)
                elif kind == STEP:
                    answer, with_params = self._sync_round(w, STEP, header, None, out), True
                else:  # FETCH or LOAD: _check let nothing else through
                    self._state_request(w, link, header, reply)
                    continue
                sends = [answer.write(reply)] + ([out] if with_params else [])
                link.exchange(sends, [], "sending the reply", self.timeout_s)
        except CollectiveTimeoutError as exc:
            self._lose(w, exc)
        except BadMessage as exc:
            self._reject(w, exc)
        except _Stopped:
            return
        except BaseException as exc:  # a bug here must stop the server, not one thread
            self._stop(exc)

    def _check(self, header: torch.Tensor) -> None:
        """Refuse a header whose numbers the shard does not allow, before acting on it."""
        problem = request_problem(self.layout, header, self.load_limit)
        if problem is None and float(header[0]) == STEP:
            with self._cond:
                # A step applies the clipped push of the round before it (sync only).
                if self.mode == "async" or self._pending is None:
                    problem = "sent a step without a clipped push before it"
        if problem is not None:
            raise BadMessage(problem)

    # -- updates ----------------------------------------------------------------
    def _push(
        self, w: int, header: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
    ) -> tuple[Reply, bool]:
        if self.mode == "async":
            return self._async_push(w, header, grad, out), True
        clipping = clip_of(header) is not None
        return self._sync_round(w, PUSH, header, grad, out), not clipping

    def _async_push(
        self, w: int, header: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
    ) -> Reply:
        with self._cond:
            step, tau = self._steps[w], self._version - self._pulled[w]
            self._apply(grad, self.layout.presence(header), self.layout.hyper_values(header))
            self._steps[w] = step + 1
            self.record.updates.append(
                UpdateRecord(self._index(w), step, self._lag[w], tau, self._version)
            )
            self._cond.notify_all()  # a worker waiting for this one may go on
            while not self._may_start(w):
                self._wait()
            self._lag[w] = self._steps[w] - min(self._steps[v] for v in self._live)
            self._pulled[w] = self._version
            out.copy_(flatten(self.params, self.dtype))
            return self._reply(w, tau=tau)

    def _may_start(self, w: int) -> bool:
        """Bounded delay: ``w`` may start its next step within ``max_staleness`` of the slowest."""
        if self.max_staleness is None:
            return True
        slowest = min(self._steps[v] for v in self._live)
        return slowest >= self._steps[w] - self.max_staleness

    def _sync_round(
        self,
        w: int,
        kind: float,
        header: torch.Tensor,
        grad: torch.Tensor | None,
        out: torch.Tensor,
    ) -> Reply:
        """Wait until every live worker sent ``kind`` for this round; one of them completes it."""
        with self._cond:
            self._arrived[w] = (kind, header, grad)
            mine = self._round
            self._complete_round()
            while self._round == mine:
                self._wait()
            if kind == STEP or clip_of(header) is None:
                out.copy_(flatten(self.params, self.dtype))
            return self._reply(w, norm=self._norm)

    def _complete_round(self) -> None:
        """Under the lock: when every live worker has arrived, run the round's update once."""
        if not self._arrived or not self._live <= set(self._arrived):
            return
        order = sorted(self._arrived)
        kinds = {self._arrived[w][0] for w in order}
        clips = {clip_of(self._arrived[w][1]) for w in order}
        if len(kinds) > 1 or len(clips) > 1:
            raise ParameterServerError(
                "workers disagree within a step (some clip their gradients, some do not): "
                "every worker must run the same loop"
            )
        first = self._arrived[order[0]][1]
        if kinds == {STEP}:
            if self._pending is None:
                raise ParameterServerError("a step without a clipped push before it")
            flat, present = self._pending
            self._apply(flat, present, self.layout.hyper_values(first))
            self._pending = None
        else:
            flat, present = self._mean(order)
            clip = clip_of(first)
            if clip is None:
                self._apply(flat, present, self.layout.hyper_values(first))
            else:
                self._norm = self._clip(flat, present, *clip)
                self._pending = (flat, present)
        self._arrived = {}
        self._round += 1
        self._cond.notify_all()

    def _mean(self, order: list[int]) -> tuple[torch.Tensor, list[bool]]:
        """The average of the workers' gradients (absent ones count as zeros, as in ddp)."""
        total = torch.zeros(self.numel, dtype=self.dtype)
        present = [False] * len(self.params)
        for w in order:
            _, header, grad = self._arrived[w]
            assert grad is not None
            total += grad
            present = [a or b for a, b in zip(present, self.layout.presence(header), strict=True)]
        return total.div_(len(order)), present

    def _clip(self, flat: torch.Tensor, present: list[bool], max_norm: float, p: float) -> float:
        """Scale the averaged gradient by the whole model's norm, summed over the servers."""
        pieces = [g for g, has in zip(self._views(flat), present, strict=True) if has]
        part = torch.zeros((), dtype=torch.float32)
        for g in pieces:
            norm = torch.linalg.vector_norm(g.float(), p)
            part = torch.maximum(part, norm) if math.isinf(p) else part + norm**p
        if self.ctx.servers > 1:
            op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
            work = dist.all_reduce(part, op=op, async_op=True)
            assert work is not None
            work.wait()
        total = float(part) if math.isinf(p) else float(part) ** (1.0 / p)
        flat.mul_(clip_coefficient(max_norm, total))
        return total

    def _apply(self, flat: torch.Tensor, present: list[bool], hypers: list[float]) -> None:
        """One optimizer step on the shard: gradient ``flat``, the pushed hyper-parameters."""
        self.layout.hypers.unpack(hypers, self.groups)
        for param, view, has in zip(self.params, self._views(flat), present, strict=True):
            param.grad = view if has else None
        self.optimizer.step()
        for param in self.params:
            param.grad = None
        self._version += 1

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for param in self.params:
            out.append(flat[at : at + param.numel()].view_as(param))
            at += param.numel()
        return out

    def _reply(self, w: int, *, tau: int = 0, norm: float = 0.0) -> Reply:
        lags = tuple(int(self._lag[v]) if v in self._live else int(GONE) for v in self.workers)
        return Reply(
            aux=0, version=self._version, lag=self._lag[w], tau=tau, norm=norm,
            live=len(self._live), lags=lags,
        )  # fmt: skip

    # -- state (checkpoints) ----------------------------------------------------
    def _state_request(self, w: int, link: Link, header: torch.Tensor, reply: torch.Tensor) -> None:
        """FETCH: send the shard and its optimizer state; LOAD: replace them with the sender's."""
        if float(header[0]) == FETCH:
            with self._cond:
                data = to_bytes(
                    {"params": flatten(self.params, self.dtype), "state": self._state()}
                )
                answer = replace(self._reply(w), aux=data.numel())
            link.exchange(
                [answer.write(reply), data], [], "sending the optimizer state", self.timeout_s
            )
            return
        # _check bounded the size by the shard: this allocation is the shard's, not the sender's.
        data = torch.zeros(int(header[1]), dtype=torch.uint8)
        link.wait(link.recv(data), "receiving a state to load", self.timeout_s)
        try:
            saved = from_bytes(data)
        except Exception as exc:  # whatever a malformed archive raises
            raise BadMessage(f"sent a state that does not load ({first_line(exc)})") from None
        shard = dict(zip(self.indices, self.params, strict=True))
        problem = state_problem(saved, shard=shard, groups=self.layout.hypers.groups)
        if problem is not None:
            raise BadMessage(problem)
        with self._cond:
            try:
                self._load(saved)
            except Exception as exc:  # torch's own checks of groups and state
                why = first_line(exc)
                raise BadMessage(f"sent a state this server's optimizer refuses ({why})") from None
        link.exchange([reply.zero_()], [], "acknowledging the loaded state", self.timeout_s)

    def _state(self) -> dict[int, Any]:
        """The shard optimizer's state, keyed by global parameter index (optimizer order)."""
        local = self.optimizer.state_dict()["state"]
        return {self.indices[i]: value for i, value in local.items()}

    def _load(self, saved: dict[str, Any]) -> None:
        """Install a checked state: the optimizer's first (it may refuse), then the parameters."""
        position = {g: i for i, g in enumerate(self.indices)}
        state = {position[g]: v for g, v in saved["state"].items() if g in position}
        groups = []
        ids = iter(range(len(self.params)))
        for gi, group in sorted(self.groups.items()):
            values = {k: v for k, v in saved["groups"][gi].items() if k != "params"}
            groups.append({**values, "params": [next(ids) for _ in group["params"]]})
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        with torch.no_grad():
            unflatten_into(saved["params"], self.params)

    # -- workers leaving --------------------------------------------------------
    def _leave(self, w: int, *, finished: bool) -> None:
        with self._cond:
            self._live.discard(w)
            (self.record.finished if finished else self.record.dropped).append(w)
            self._arrived.pop(w, None)
            self._complete_round()  # the round may have waited for this worker alone
            self._cond.notify_all()

    def _lose(self, w: int, exc: CollectiveTimeoutError) -> None:
        me, detail = self.ctx.global_cluster.rank, short(exc.__cause__ or exc)
        if self.mode == "async" and lost(exc):
            self._leave(w, finished=False)
            print(
                f"manygpu: parameter server rank {me}: worker rank {w} is gone ({detail}); "
                f"asynchronous training goes on with {len(self._live)} worker(s)",
                file=sys.stderr,
                flush=True,
            )
            return
        if lost(exc):
            why = (
                f"worker rank {w} is gone ({detail}); a synchronous step needs every worker, "
                "so the job ends (mode='async' goes on without it)"
            )
        else:
            why = (
                f"worker rank {w} sent nothing within {self.timeout_s:g}s ({detail}); raise "
                "the timeout (timeout_s, MANYGPU_TIMEOUT) if its steps are that slow"
            )
        self._stop(ParameterServerError(f"parameter server rank {me}: {why}"))

    def _reject(self, w: int, exc: BadMessage) -> None:
        """A worker broke the protocol: as for a lost worker, async drops it and sync ends."""
        line = f"parameter server rank {self.ctx.global_cluster.rank}: worker rank {w} {exc}"
        if self.mode == "async":
            self._leave(w, finished=False)
            print(
                f"manygpu: {line}; asynchronous training goes on with {len(self._live)} worker(s)",
                file=sys.stderr,
                flush=True,
            )
            return
        self._stop(
            ParameterServerError(f"{line}; a synchronous step needs every worker, so the job ends")
        )

    def _stop(self, exc: BaseException) -> None:
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
            self._cond.notify_all()

    def _wait(self) -> None:
        """Wait on the lock's condition (bounded, to notice a fatal error)."""
        self._cond.wait(0.5)
        if self._fatal is not None:
            raise _Stopped

    def _index(self, w: int) -> int:
        return w - self.ctx.servers
