"""Throughput on hosts that differ: ring all-reduce versus parameter servers, sync and async.

:mod:`.perf` times one step of identical devices. The trade-off the classic
tutorials describe needs hosts that differ *by design*: one whose steps or
link are slower (a planning input; a rank found slow while a job runs is a
straggler, :mod:`manygpu.observe.straggler_rules`). Every host here has its
own compute time per step and its own link; the formulas are the alpha-beta ones of :mod:`.perf`:

- ring all-reduce (ddp): every step waits for the slowest host, then the
  ring runs at its slowest link: ``max c + 2 (N-1)/N S / min B + 2 (N-1) alpha``;
- sync parameter servers: every step waits for the slowest worker, then the
  push and the pull each wait for the busier end (a worker's own link, or a
  server's, which carries ``W/K`` of every exchange);
- async parameter servers: each worker cycles on its own
  (``c_w + (G + P) / B_w + 2 alpha``) and the rates add up, capped by what
  the servers' links carry. With ``max_staleness`` set, no worker can stay
  more than that many steps ahead of the slowest, so in the long run all
  run at the slowest worker's rate.

Communication is not overlapped with compute (CPU processes, and parameter
servers that push after the backward). Which formula applies comes from the
strategy's card (``CommModel.grads``), not from its name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from manygpu.errors import UsageError
from manygpu.plan.perf import ring_allreduce_s
from manygpu.strategies.registry import card


@dataclass(frozen=True, kw_only=True)
class HostRates:
    """One process's host as the step model sees it."""

    compute_s: float
    """Forward and backward of one worker's batch."""
    bw_gbs: float
    """Its link, GB/s (1e9 bytes) in each direction."""


def ring_step_s(hosts: Sequence[HostRates], grad_bytes: float, latency_us: float) -> float:
    """One ring all-reduce step on ``hosts`` (every host trains)."""
    slowest_link = min(h.bw_gbs for h in hosts)
    comm = ring_allreduce_s(grad_bytes, len(hosts), slowest_link, latency_us)
    return max(h.compute_s for h in hosts) + comm


def _phase_s(nbytes: float, workers: Sequence[HostRates], servers: Sequence[HostRates]) -> float:
    """One push (or pull) of ``nbytes`` per worker: the busier end's transfer time."""
    per_server = len(workers) * nbytes / len(servers)
    worker_side = max(nbytes / (w.bw_gbs * 1e9) for w in workers)
    server_side = max(per_server / (s.bw_gbs * 1e9) for s in servers)
    return max(worker_side, server_side)


def ps_sync_step_s(
    workers: Sequence[HostRates],
    servers: Sequence[HostRates],
    grad_bytes: float,
    weight_bytes: float,
    latency_us: float,
) -> float:
    """One synchronous step: the slowest worker's compute, then push and pull."""
    exchange = _phase_s(grad_bytes, workers, servers) + _phase_s(weight_bytes, workers, servers)
    return max(w.compute_s for w in workers) + exchange + 2 * latency_us * 1e-6


def ps_async_updates_per_s(
    workers: Sequence[HostRates],
    servers: Sequence[HostRates],
    grad_bytes: float,
    weight_bytes: float,
    latency_us: float,
    max_staleness: int | None = None,
) -> float:
    """Updates the servers apply per second, each worker cycling at its own pace."""
    cycles = [
        w.compute_s + (grad_bytes + weight_bytes) / (w.bw_gbs * 1e9) + 2 * latency_us * 1e-6
        for w in workers
    ]
    rates = [1.0 / c for c in cycles]
    total = len(workers) * min(rates) if max_staleness is not None else sum(rates)
    capacity = sum(s.bw_gbs * 1e9 for s in servers) / max(grad_bytes, weight_bytes)
    return min(total, capacity)


def samples_per_s(
    strategy: str,
    hosts: Sequence[HostRates],
    *,
    batch: int,
    grad_bytes: float,
    weight_bytes: float,
    latency_us: float,
    servers: int = 0,
    mode: str = "sync",
    max_staleness: int | None = None,
) -> float:
    """Predicted training samples per second of ``strategy`` on ``hosts``.

    ``batch``: samples per worker per step. For parameter servers the first
    ``servers`` hosts serve and the others train (as ``manygpu launch --ps``
    places them); ``mode`` and ``max_staleness`` are :class:`~manygpu.PS`'.
    """
    grads = card(strategy).comm.grads
    if grads == "all_reduce":
        return len(hosts) * batch / ring_step_s(hosts, grad_bytes, latency_us)
    if grads != "push_pull":
        raise UsageError(
            f"the straggler model covers ring all-reduce and parameter servers, not {strategy!r}"
        )
    if not 1 <= servers < len(hosts):
        raise UsageError(f"give 1 <= servers < {len(hosts)} hosts, got {servers}")
    serving, training = hosts[:servers], hosts[servers:]
    if mode == "async":
        updates = ps_async_updates_per_s(training, serving, grad_bytes, weight_bytes,
                                         latency_us, max_staleness)  # fmt: skip
        return updates * batch
    step = ps_sync_step_s(training, serving, grad_bytes, weight_bytes, latency_us)
    return len(training) * batch / step
