"""Point-to-point send / receive with a timeout (used by the all-reduce algorithms)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from manygpu.comm.common import DEFAULT_TIMEOUT_S, describe, require_tensor, wait


def send(tensor: torch.Tensor, dst: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until it is handed over."""
    require_tensor("send", tensor)
    wait(dist.isend(tensor.contiguous(), dst), describe(f"send[dst={dst}]", tensor), timeout_s)


def recv(tensor: torch.Tensor, src: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Receive into ``tensor`` from rank ``src`` and return it."""
    require_tensor("recv", tensor)
    wait(dist.irecv(tensor, src), describe(f"recv[src={src}]", tensor), timeout_s)
    return tensor


def exchange(
    send_buf: torch.Tensor,
    dst: int,
    recv_buf: torch.Tensor,
    src: int,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """Send to ``dst`` and receive from ``src`` at the same time (no deadlock in a ring)."""
    require_tensor("exchange", send_buf)
    require_tensor("exchange", recv_buf)
    ops = [
        dist.P2POp(dist.isend, send_buf.contiguous(), dst),
        dist.P2POp(dist.irecv, recv_buf, src),
    ]
    for work in dist.batch_isend_irecv(ops):
        wait(work, f"exchange[send to {dst}, recv from {src}]", timeout_s)
    return recv_buf
