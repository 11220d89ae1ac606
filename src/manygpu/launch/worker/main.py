"""What each launched process runs first: the user's script, with its error recorded.

``python -m manygpu.launch.worker [-m] ENTRY ARGS...`` behaves like
``python ENTRY ARGS...`` (or ``python -m ENTRY``): same ``sys.argv``, same
``sys.path[0]``, ``__name__ == "__main__"``. On an uncaught exception it also
writes the traceback to torch elastic's error file, so the launcher can show
the failing rank's error even when the script has no ``@record`` decorator.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import threading
import traceback

from manygpu.launch import blame, evidence
from manygpu.launch.worker import exit_timer, keeper
from manygpu.runtime import env as envmod
from manygpu.runtime import notice
from manygpu.runtime.heap import freeze_after_torch_import


def _record(exc: BaseException) -> None:
    """Write ``exc`` to ``TORCHELASTIC_ERROR_FILE`` (the agent reads it)."""
    if not envmod.error_file(envmod.current()):
        return
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    ErrorHandler().record_exception(exc)


def run(argv: list[str]) -> None:
    """Run the program named by ``argv`` as ``__main__``."""
    if not argv:
        raise SystemExit("usage: python -m manygpu.launch.worker [-m] ENTRY [ARGS...]")
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    # Absolute, as python (and so torchrun) makes a main script's __file__.
    runpy.run_path(os.path.abspath(script), run_name="__main__")


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the launcher dies, even by SIGKILL, so no worker is orphaned."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before we asked
        os._exit(1)


def _default_group_timeout() -> None:
    """``--timeout`` becomes torch's default process-group timeout in this worker.

    Collectives of a group created without ``timeout=`` (any torchrun script)
    then end with an error after ``--timeout`` seconds instead of torch's 30
    minutes. Only when the user asked (MANYGPU_TIMEOUT set by the launcher).
    """
    env = envmod.current()
    if not envmod.get_str(env, "MANYGPU_TIMEOUT"):
        return
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    limit = timedelta(seconds=envmod.timeout_s(env))
    c10d.default_pg_timeout = limit
    c10d.default_pg_nccl_timeout = limit


# Run by the guardian (a fresh, tiny interpreter): wait for the worker to go,
# then kill what is left of its process group (the script's own children).
# The worker writes one byte to the pipe when its script has returned and its
# exit timer is armed; just before the timer ends a worker stuck at exit, the
# guardian says so (while the launcher still reads the worker's output).
_GUARD = """
import os, select, signal, sys, time
worker, group, pipe = map(int, sys.argv[1:4])
grace = float(sys.argv[4])
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
returned = None
while os.getppid() == worker:
    if returned is None and select.select([pipe], [], [], 0.5)[0]:
        returned = time.monotonic() if os.read(pipe, 1) else float("inf")
    elif returned is not None:
        if time.monotonic() - returned >= grace - 0.25:
            rank = os.environ.get("RANK", "?")
            sys.stderr.write(
                "manygpu: rank %s: the script returned, but the process was still running "
                "%gs later (stuck at exit; every thread's stack is above); ending it, as a "
                "success (MANYGPU_EXIT_GRACE sets the wait)\\n" % (rank, grace)
            )
            sys.stderr.flush()
            returned = float("inf")
        time.sleep(0.1)
try:
    os.killpg(group, signal.SIGKILL)
except OSError:
    pass
"""

# Write end of the pipe to the guardian (-1: no guardian).
_RETURNED_FD = -1


def _guard_descendants() -> None:
    """Make sure the script's own children die with this worker, however it ends.

    The agent starts each worker as the leader of a new session, so the
    script's children share its process group. PR_SET_PDEATHSIG kills the
    worker with the launcher, but not their children: a guardian process
    (ignoring the usual stop signals) waits for the worker to go and then
    kills the group, stragglers included.
    """
    global _RETURNED_FD
    if not sys.platform.startswith("linux") or os.getpgid(0) != os.getpid():
        return
    worker = os.getpid()
    grace = envmod.exit_grace_s(envmod.current())
    read_fd, _RETURNED_FD = os.pipe()
    if os.fork() == 0:
        try:
            os.set_inheritable(read_fd, True)
            argv = [str(worker), str(worker), str(read_fd), str(grace)]
            os.execv(sys.executable, [sys.executable, "-S", "-c", _GUARD, *argv])
        finally:
            os._exit(0)
    os.close(read_fd)


def _finish() -> None:
    """The script has returned: wait for its threads as Python would, then arm the exit timer.

    The note that it returned lets the launcher say so of a rank that still dies
    in the interpreter's shutdown.
    """
    blame.write(kind=blame.RETURNED, code=0, consequence=False)
    evidence.note_if_alone(envmod.current())
    _release_group()
    _shut_threads_down()
    sys.stdout.flush()
    sys.stderr.flush()
    if exit_timer.arm(envmod.exit_grace_s(envmod.current())) and _RETURNED_FD >= 0:
        with contextlib.suppress(OSError):
            os.write(_RETURNED_FD, b"r")


def _shut_threads_down() -> None:
    """What the interpreter does first at exit: threading's exit hooks, then join threads.

    The hooks (``threading._register_atexit``) are how ``concurrent.futures``
    tells its pool threads, non-daemon since Python 3.9, to quit; joining the
    threads without running them waits forever on an idle pool (torch's async
    compile keeps one), although plain ``python`` exits at once.
    ``threading._shutdown`` is the function the interpreter itself calls; it
    runs the hooks, then joins every non-daemon thread, and is a no-op when
    the interpreter calls it again.
    """
    shutdown = getattr(threading, "_shutdown", None)
    if callable(shutdown):
        shutdown()
        return
    for thread in threading.enumerate():  # another Python: join, as before
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def main() -> None:
    _die_with_parent()
    _guard_descendants()
    if keeper.applies(envmod.current()):
        keeper.keep()  # from here on, this is the child that runs the script
    freeze_after_torch_import()  # before this worker's first import of torch, wherever it is
    _default_group_timeout()
    notice.record_warnings()  # SIGUSR1 would end the rank before any save
    with contextlib.suppress(OSError):  # no watch is better than no job
        evidence.start(envmod.current())
    try:
        run(sys.argv[1:])
        _finish()
    except KeyboardInterrupt:
        # Ctrl-C reaches the workers through the launcher, which says it once.
        blame.write(kind="interrupted", code=130, consequence=True)
        if envmod.traceback_wanted(envmod.current()):
            traceback.print_exc()
        _end(130)
    except SystemExit as exc:
        code = _exit_code(exc.code)
        if code == 0:
            _finish()
            raise
        blame.write(kind="exit", code=code, consequence=False)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        _end(code)
    except BaseException as exc:
        _record(exc)
        blame.write(kind="exception", code=1, consequence=blame.is_peer_failure(exc))
        _print_error(exc)
        _end(1)


def _print_error(exc: BaseException) -> None:
    """The traceback, except for a configuration error (a :class:`UsageError`) and a
    collective that lost its peer (:class:`PeerLostError`, the backend's words in
    it): those are one line, the launcher's to say (once for every rank alike; a
    dead peer's consequences after the peer's own death), unless
    ``MANYGPU_TRACEBACK=1``; with no launcher to read the error file, this rank says it."""
    from manygpu.errors import CollectiveTimeoutError, PeerLostError, UsageError, peer_lost

    env = envmod.current()
    if isinstance(exc, CollectiveTimeoutError):  # ours: a timeout keeps its traceback
        lost = isinstance(exc, PeerLostError) or peer_lost(str(exc))  # Horovod's form too
    else:  # the backend's own (FSDP's all-gather raises gloo's RuntimeError as it is)
        lost = blame.is_peer_failure(exc)
    if not (isinstance(exc, UsageError) or lost) or envmod.traceback_wanted(env):
        traceback.print_exc()
    elif not envmod.error_file(env):
        print(f"manygpu: rank {env.get('RANK', '?')}: {exc}", file=sys.stderr)


def _exit_code(code: object) -> int:
    """``sys.exit``'s argument as the process would turn it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    return 1


def _end(code: int) -> None:
    """Exit with ``code`` now if a process group is alive, else normally.

    A collective may still be pending in a backend thread; a normal interpreter
    exit would then abort in C++ (SIGABRT) and hide the exit code.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if _group_alive():
        os._exit(code)
    raise SystemExit(code) from None


def _release_group() -> None:
    """Destroy a process group the script left behind, before the interpreter exits.

    Otherwise its destructor runs during interpreter shutdown, where gloo's
    destructor can wait (holding the GIL) for a backend thread that waits for
    the GIL: a finished job that never exits. Every collective of the script
    has returned by now, so destroying this rank's group is safe.
    """
    if _group_alive():
        import torch.distributed as dist

        with contextlib.suppress(Exception):  # best effort: the script's work is done
            dist.destroy_process_group()


def _group_alive() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


if __name__ == "__main__":
    main()
