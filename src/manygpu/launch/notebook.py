"""``notebook_launcher``: N workers forked from a notebook cell, as Accelerate's does.

A notebook's functions live in the kernel's ``__main__`` and cannot be pickled
for a fresh interpreter, so the workers are forked: each is the kernel as it
was, made one rank of a one-machine job (torchrun's variables: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``...), so ``Parallel()`` inside the function
joins it, on CPUs (gloo) or one GPU per worker. CUDA cannot be used in a
forked child of a process that has initialised it: that is refused before any
fork, in one line.

What comes back: each rank's return value, in rank order (pickled through a
pipe); or, when a rank fails, one :class:`~manygpu.errors.LaunchError` naming
the first rank that failed on its own (a peer that lost it is a consequence,
as ``manygpu launch`` reports), its exception's class and message, with the
worker's traceback as the cause. The other workers are stopped. Ctrl-C
("interrupt the kernel") stops every worker and raises ``KeyboardInterrupt``
in the cell. A worker ends with ``os._exit``: the kernel's own exit handlers
must not run in its forks.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from manygpu.errors import LaunchError, UsageError
from manygpu.launch import blame
from manygpu.runtime import env as envmod

STOP_GRACE_S = 5.0
"""How long stopped workers get after SIGTERM before SIGKILL."""


class RemoteTraceback(Exception):
    """A worker's traceback, as text: the cause of the :class:`LaunchError` in the cell."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class _Ended:
    """What one worker sent before it ended (``kind``: ``ok``, ``error``, ``interrupted``)."""

    kind: str
    value: Any = None
    error: str = ""
    trace: str = ""
    consequence: bool = False
    time_ns: int = 0


def notebook_launcher(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nproc: int | None = None,
    *,
    master_port: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` forked workers, one rank each; their return values.

    ``nproc`` defaults to the GPUs torch sees; on a CPU-only machine give it.
    ``master_port``: where the workers meet (default: a free port of this machine).

    Raises:
        UsageError: CUDA is already initialised in this kernel, or a bad ``nproc``.
        LaunchError: a worker failed (the first that failed on its own is named).
    """
    count = _worker_count(nproc)
    _refuse_initialised_cuda()
    port = master_port if master_port is not None else _free_port()
    ctx = multiprocessing.get_context("fork")
    workers, pipes = [], []
    for rank in range(count):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(fn, tuple(args), rank, count, port, send))
        proc.start()
        send.close()
        workers.append(proc)
        pipes.append(receive)
    try:
        ended = _wait_all(workers, pipes)
    except KeyboardInterrupt:  # "interrupt the kernel"
        _stop(workers)
        print(f"manygpu: interrupted; stopped {count} workers", file=sys.stderr)
        raise
    except BaseException:
        _stop(workers)
        raise
    finally:
        for pipe in pipes:
            pipe.close()
    return [e.value for e in ended]


def _worker_count(nproc: int | None) -> int:
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count()  # counts without initialising CUDA
        if nproc == 0:
            raise UsageError(
                "notebook_launcher: no GPU here; give the number of CPU workers, nproc=2"
            )
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise UsageError(f"notebook_launcher: nproc={nproc!r}; give a number of workers >= 1")
    return nproc


def _refuse_initialised_cuda() -> None:
    """A fork of a process that initialised CUDA cannot use it: say so before forking."""
    import torch

    if torch.cuda.is_initialized():
        raise UsageError(
            "notebook_launcher: CUDA is already initialised in this kernel, and forked "
            "workers cannot use it; restart the kernel and call notebook_launcher before "
            "anything touches the GPU (no .cuda() / torch.cuda calls in earlier cells)"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world: int, port: int,
    send: Connection,
) -> None:  # fmt: skip
    """One rank: run ``fn``, send how it ended, and leave without the kernel's exit hooks."""
    envmod.export_worker(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port)
    # The kernel's handlers are not this worker's: Ctrl-C is a KeyboardInterrupt in
    # fn, a SIGTERM from the cell (stopping the job) ends it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 0
    try:
        ended = _Ended("ok", value=fn(*args))
    except KeyboardInterrupt:
        ended, code = _Ended("interrupted", consequence=True, time_ns=time.time_ns()), 130
    except BaseException as exc:  # sent to the cell, which raises it as the job's error
        error = f"{type(exc).__name__}: {exc}"
        ended = _Ended("error", error=error, trace=traceback.format_exc(),
                       consequence=blame.is_peer_failure(exc), time_ns=time.time_ns())  # fmt: skip
        code = 1
    try:
        send.send(ended)
    except Exception as exc:  # a return value that does not pickle
        why = f"rank {rank}'s return value cannot be sent back: {type(exc).__name__}: {exc}"
        send.send(_Ended("error", error=why, time_ns=time.time_ns()))
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _wait_all(workers: list[Any], pipes: list[Connection]) -> list[_Ended]:
    """Every worker's end; at the first failure the others are stopped and it is raised."""
    ended: dict[int, _Ended] = {}
    exits: dict[int, tuple[int, int]] = {}  # rank -> (exit code, when it was seen)
    while len(exits) < len(workers):
        ready = wait([*pipes, *(w.sentinel for w in workers)], timeout=1.0)
        for rank, worker in enumerate(workers):
            _receive(rank, pipes[rank], ended)
            if worker.sentinel in ready and rank not in exits:
                worker.join()
                exits[rank] = (worker.exitcode, time.time_ns())
                _receive(rank, pipes[rank], ended)
                if exits[rank][0] != 0 or ended.get(rank, _Ended("?")).kind != "ok":
                    _stop(workers)
                    for other, stopped in enumerate(workers):
                        _receive(other, pipes[other], ended)
                        exits.setdefault(other, (stopped.exitcode or 0, time.time_ns()))
                    raise _failure(ended, exits)
    return [ended[r] for r in range(len(workers))]


def _receive(rank: int, pipe: Connection, ended: dict[int, _Ended]) -> None:
    """What worker ``rank`` sent, once, if it has sent it."""
    if rank in ended:
        return
    with contextlib.suppress(EOFError, OSError):
        if pipe.poll():
            ended[rank] = pipe.recv()


def _failure(ended: dict[int, _Ended], exits: dict[int, tuple[int, int]]) -> LaunchError:
    """The first rank that failed on its own (else the first of all), as the cell's error."""
    outcomes, sent = [], {}
    for rank, (code, seen_ns) in exits.items():
        end = ended.get(rank)
        if end is not None and end.kind != "ok":
            how = f"failed: {end.error}" if end.kind == "error" else "was interrupted"
            outcomes.append(blame.Outcome(rank, code or 1, end.time_ns, end.consequence, how))
            sent[rank] = end
        elif code != 0:
            signum = -code if code < 0 else 0
            how = f"was killed by {signal.Signals(signum).name}" if signum else f"exited {code}"
            stopped = signum == signal.SIGTERM  # ours: the survivors of a failure
            exit_code = 128 + signum if signum else code
            outcomes.append(blame.Outcome(rank, exit_code, seen_ns, stopped, how))
    root = blame.root_cause(outcomes)
    error = LaunchError(f"notebook_launcher: rank {root.rank} {root.how}", root.exit_code)
    end = sent.get(root.rank)
    if end is not None and end.trace:
        error.__cause__ = RemoteTraceback(f"\n\nrank {root.rank}'s traceback:\n{end.trace}")
    return error


def _stop(workers: list[Any]) -> None:
    """SIGTERM every live worker, SIGKILL those left after :data:`STOP_GRACE_S`."""
    for worker in workers:
        if worker.is_alive():
            with contextlib.suppress(OSError):
                os.kill(worker.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join()
