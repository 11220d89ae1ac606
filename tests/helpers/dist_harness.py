"""Run a function on N real gloo ranks on 127.0.0.1 and collect every rank's answer.

Each rank is a new process with the torchrun environment variables set (free
port, ``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1``); the parent waits with
a hard deadline, kills stragglers, and fails with every failing rank's
traceback prefixed by its rank, or names the rank that died without one. The
process group is destroyed in ``finally`` on every rank.

Ranks are forked from a server that has already imported torch (and what the
collected test modules asked for with :func:`preload`): multiprocessing's
``forkserver``, started once per test session. A test then pays for its own
work, not for a torch import per rank (~2.5 s of CPU each). Every rank is
still a fresh process, so nothing one test leaves behind (environment, signal
handlers, RNG state, a half-dead process group) reaches the next; that is why
ranks are not pooled and reused across tests.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

HELPERS = Path(__file__).resolve().parent

# The server imports these before it forks any rank; rank_preload.py reads the
# lists from the environment the server starts with.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "manygpu",
    "manygpu.core.parallel",
    "manygpu.strategies.ddp.strategy",
    "manygpu.strategies.fsdp.strategy",
    "manygpu.strategies.tensor.strategy",
    "manygpu.strategies.pipeline.strategy",
    "manygpu.comm",
    "pytest",
    "reference",
]
PRELOAD_ENV, SYS_PATH_ENV = "DIST_HARNESS_PRELOAD", "DIST_HARNESS_SYS_PATH"

# What torchrun sets; a rank must never inherit them from the test process.
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def preload(*modules: str) -> None:
    """Have the rank server import ``modules`` too (call at a test module's import).

    Test modules are imported at collection, before the first test starts the
    server; a module named later is simply imported by each rank itself.
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


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


@contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: removed), restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _context() -> Any:
    """The forkserver context, its server running (started here the first time).

    The server takes its environment from this process at start: OpenMP reads
    ``OMP_NUM_THREADS`` once, when torch loads, so it is set here, not per rank.
    Python 3.11's forkserver ignores the parent's ``sys.path``, hence the helpers
    directory on ``PYTHONPATH`` and the whole path handed to rank_preload.py.
    CUDA cannot be used in a process forked after the driver started, so the
    server must never start it: a ``torch.cuda.is_available()`` run by some
    import asks NVML instead (the ranks' own environment does not have this).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rank_preload"])
    path = os.pathsep.join(p for p in (str(HELPERS), os.environ.get("PYTHONPATH")) if p)
    with _environ(
        PYTHONPATH=path,
        OMP_NUM_THREADS="1",
        PYTORCH_NVML_BASED_CUDA_CHECK="1",
        **{PRELOAD_ENV: ",".join(_PRELOAD), SYS_PATH_ENV: json.dumps(sys.path)},
        **dict.fromkeys(JOB_VARIABLES),
    ):
        forkserver.ensure_running()
    return ctx


def _entry(
    fn: Callable[..., Any],
    rank: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    out: Any,
) -> None:
    # The environment a spawned process would have had: the test's, plus the rank's.
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    # OpenMP read OMP_NUM_THREADS when the server loaded torch; a rank asking
    # for more threads (extra_env) gets them here.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    # A forked rank would share the server's random state; a new process draws
    # its own (Python's random reseeds itself after a fork).
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()

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


def _death(proc: Any) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 90.0,
    extra_env: dict[str, str] | None = None,
) -> list[Any]:
    """``fn(*args)`` on ``world`` ranks; returns the results in rank order.

    ``fn`` must be importable by name (a module-level function). Fails, with
    every rank's traceback, if any rank raised; at once if a rank died without
    an answer (the others would only wait for it); after ``timeout`` seconds
    if some rank hangs.
    """
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    procs = []
    for rank in range(world):
        env = base | rank_env(rank, world, port) | (extra_env or {})
        proc = ctx.Process(target=_entry, args=(fn, rank, env, args, out), daemon=True)
        proc.start()
        procs.append(proc)
    results: dict[int, tuple[bool, Any]] = {}
    died: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and not died:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = out.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                # A rank that is gone without an answer never sends one: its
                # answer would already be in the queue (it is written before exit).
                gone = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
                if gone and out.empty():
                    died = {r: _death(procs[r]) for r in gone}
                continue
            results[rank] = (ok, value)
    finally:
        answered = len(results) == world
        for proc in procs:
            if not answered:  # hung, or waiting for a peer that died: nothing to wait for
                proc.kill()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failures = [f"[rank {r}] {v}" for r, (ok, v) in sorted(results.items()) if not ok]
    failures += [f"[rank {r}] {how} before answering" for r, how in sorted(died.items())]
    missing = [r for r in range(world) if r not in results and r not in died]
    if missing and not died:
        failures.append(f"ranks {missing} gave no answer within {timeout:.0f}s (hung or crashed)")
    if failures:
        raise AssertionError("\n".join(failures))
    return [pickle.loads(results[r][1]) for r in range(world)]


def away_until_marked(marks: str, count: int, longest_s: float) -> None:
    """A rank that never makes the call its peers wait in stays away until ``count`` of
    them have marked ``marks`` (:func:`mark`) or ``longest_s`` passed: a fixed sleep
    kept the job, and the test, waiting long after the peers had seen the stall
    (tests/distributed/test_horovod_errors.py: 3 s less of its ~11)."""
    deadline = time.monotonic() + longest_s
    while len(os.listdir(marks)) < count and time.monotonic() < deadline:
        time.sleep(0.1)


def mark(marks: str, rank: int) -> None:
    """Say, in ``marks``, that this rank is done waiting for a peer that stays away."""
    Path(marks, f"rank{rank}").touch()
