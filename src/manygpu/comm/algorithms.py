"""All-reduce algorithms over point-to-point messages, to measure against the backends.

These are for measurement and teaching: ``manygpu bench comm`` compares them
with the backend's native all-reduce. Training uses the backends (NCCL, gloo).

With N ranks and S bytes (alpha = per-message latency, beta = seconds per byte):

- **ring** (Baidu / Horovod): reduce-scatter then all-gather around a ring, in
  N chunks. 2(N-1) steps, each rank sends 2(N-1)/N * S bytes: bandwidth-optimal,
  time ~ 2(N-1) alpha + 2(N-1)/N S beta.
- **parameter server**: everyone sends to one server rank, which sums and sends
  back. The server's link carries 2(N-1) S bytes: time ~ 2(N-1) S beta.
- **tree** (binomial): reduce up a binomial tree, broadcast down it. 2 ceil(log2 N)
  steps of the whole tensor: latency-optimal, time ~ 2 log2(N) (alpha + S beta).

Each sums in place and returns the tensor; every message is bounded by the timeout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from manygpu.comm.common import DEFAULT_TIMEOUT_S, active, describe, wait
from manygpu.comm.p2p import exchange, recv, send

AllReduce = Callable[..., torch.Tensor]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("all-reduce algorithms need a contiguous tensor; call .contiguous()")
    return tensor.view(-1)


def ring_all_reduce(tensor: torch.Tensor, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Sum ``tensor`` over ranks with a ring: reduce-scatter, then all-gather."""
    if not active():
        return tensor
    n, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    chunks = list(_flat(tensor).tensor_split(n))
    # Reduce-scatter: after step s, the chunk received holds s+2 ranks' sum;
    # after N-1 steps rank r owns the full sum of chunk (r+1) % n.
    for step in range(n - 1):
        send_idx, recv_idx = (r - step) % n, (r - step - 1) % n
        incoming = torch.empty_like(chunks[recv_idx])
        exchange(chunks[send_idx], right, incoming, left, timeout_s=timeout_s)
        chunks[recv_idx].add_(incoming)
    # All-gather: pass the finished chunks around the ring once.
    for step in range(n - 1):
        send_idx, recv_idx = (r + 1 - step) % n, (r - step) % n
        exchange(chunks[send_idx], right, chunks[recv_idx], left, timeout_s=timeout_s)
    return tensor


def parameter_server_all_reduce(
    tensor: torch.Tensor, *, server: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S
) -> torch.Tensor:
    """Sum ``tensor`` over ranks through one server rank (the pre-Horovod design)."""
    if not active():
        return tensor
    flat, n, r = _flat(tensor), dist.get_world_size(), dist.get_rank()
    if r != server:
        send(flat, server, timeout_s=timeout_s)
        recv(flat, server, timeout_s=timeout_s)
        return tensor
    peers = [p for p in range(n) if p != server]
    # Post every receive at once: the server's link, not the posting order, limits.
    buffers = [torch.empty_like(flat) for _ in peers]
    works = [dist.irecv(buf, peer) for buf, peer in zip(buffers, peers, strict=True)]
    for work, buf, peer in zip(works, buffers, peers, strict=True):
        wait(work, describe(f"recv[src={peer}]", buf), timeout_s)
        flat.add_(buf)
    sends = [dist.isend(flat, peer) for peer in peers]
    for work, peer in zip(sends, peers, strict=True):
        wait(work, describe(f"send[dst={peer}]", flat), timeout_s)
    return tensor


def tree_all_reduce(tensor: torch.Tensor, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Sum ``tensor`` over ranks up and down a binomial tree rooted at rank 0."""
    if not active():
        return tensor
    flat, n, r = _flat(tensor), dist.get_world_size(), dist.get_rank()
    mask = 1
    while mask < n:  # reduce: at level `mask`, odd multiples send to their parent
        if r & mask:
            send(flat, r - mask, timeout_s=timeout_s)
            break
        if r + mask < n:
            incoming = torch.empty_like(flat)
            flat.add_(recv(incoming, r + mask, timeout_s=timeout_s))
        mask <<= 1
    top = 1
    while top < n:
        top <<= 1
    low = top if r == 0 else r & -r
    if r != 0:  # broadcast: receive from the parent, then feed the subtree
        recv(flat, r - low, timeout_s=timeout_s)
    child = low >> 1
    while child >= 1:
        if r + child < n:
            send(flat, r + child, timeout_s=timeout_s)
        child >>= 1
    return tensor


ALGORITHMS: dict[str, AllReduce] = {
    "ring": ring_all_reduce,
    "ps": parameter_server_all_reduce,
    "tree": tree_all_reduce,
}
"""Our all-reduce algorithms by name (the benchmark adds ``"native"``)."""
