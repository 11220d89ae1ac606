"""Run a function on N real gloo ranks on 127.0.0.1 and collect every rank's answer.

Each rank is a spawned process with the torchrun environment variables set
(free port, ``GLOO_SOCKET_IFNAME=lo``); the parent waits with a hard deadline,
kills stragglers, and fails with every failing rank's traceback prefixed by
its rank. The process group is destroyed in ``finally`` on every rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A port nobody listens on right now (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun would give rank ``rank``."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


def _entry(
    fn: Callable[..., Any], rank: int, env: dict[str, str], args: tuple[Any, ...], out: Any
) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    ok, result = True, None
    try:
        result = fn(*args)
    except BaseException:
        ok, result = False, traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Plain pickle, after the group is gone: torch's queue reducer would share
    # tensors through file descriptors that die with this process.
    out.put((rank, ok, pickle.dumps(result) if ok else result))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 90.0,
    extra_env: dict[str, str] | None = None,
) -> list[Any]:
    """``fn(*args)`` on ``world`` ranks; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port) | (extra_env or {})
        proc = ctx.Process(target=_entry, args=(fn, rank, env, args, out), daemon=True)
        proc.start()
        procs.append(proc)
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
                continue
            results[rank] = (ok, value)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failures = [f"[rank {r}] {v}" for r, (ok, v) in sorted(results.items()) if not ok]
    missing = [r for r in range(world) if r not in results]
    if missing:
        failures.append(f"ranks {missing} gave no answer within {timeout:.0f}s (hung or crashed)")
    if failures:
        raise AssertionError("\n".join(failures))
    return [pickle.loads(results[r][1]) for r in range(world)]
