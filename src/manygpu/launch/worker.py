"""What each launched process runs first: the user's script, with its error recorded.

``python -m manygpu.launch.worker [-m] ENTRY ARGS...`` behaves like
``python ENTRY ARGS...`` (or ``python -m ENTRY``): same ``sys.argv``, same
``sys.path[0]``, ``__name__ == "__main__"``. On an uncaught exception it also
writes the traceback to torch elastic's error file, so the launcher can show
the failing rank's error even when the script has no ``@record`` decorator.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def _record(exc: BaseException) -> None:
    """Write ``exc`` to ``TORCHELASTIC_ERROR_FILE`` (the agent reads it)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
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
    runpy.run_path(script, run_name="__main__")


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


def main() -> None:
    _die_with_parent()
    try:
        run(sys.argv[1:])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        _record(exc)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        if _is_distributed_failure(exc):
            # A collective is still pending in a backend thread; a normal
            # interpreter exit would abort in C++ (SIGABRT) and hide the exit code.
            os._exit(1)
        raise SystemExit(1) from None


def _is_distributed_failure(exc: BaseException) -> bool:
    from manygpu.errors import CollectiveTimeoutError

    return isinstance(exc, CollectiveTimeoutError) or type(exc).__module__.startswith(
        "torch.distributed"
    )


if __name__ == "__main__":
    main()
