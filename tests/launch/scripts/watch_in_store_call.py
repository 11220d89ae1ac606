"""``python -m manygpu`` whose hang watch is inside a store call when the job ends.

The launcher aborted once at its exit after a good job (SIGABRT, "terminate
called without an active exception"): its hang watch, a daemon thread, came
back from a store call (native code that releases the GIL) while the
interpreter finalized, and Python ends such a thread with ``pthread_exit``,
whose unwinding through pybind11's GIL guard calls ``std::terminate``. On a
loaded machine a store call lasts long enough to meet the end; here it does
every time:

- once the agent has returned, the watch's store calls each wait 1 s in the
  store (``wait`` on a key that is not there) and the launcher goes on only
  once the watch is inside one;
- finalizing takes a while: an object's ``__del__``, run after Python has
  begun to end threads, sets that key, so a wait still pending returns, and
  sleeps to give that thread its moment.

A launcher that waits for its watch to leave the store before it returns
exits 0; otherwise this process aborts. argv: ``launch ...`` as for manygpu.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from manygpu.cli.main import main
from manygpu.launch import agent, hangwatch

KEY = "manygpu-test/released"
STORE = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), use_libuv=True)
ENDED = threading.Event()
IN_CALL = threading.Event()


class SlowStore:
    """A quiet job store whose ``check``, once the job has ended, waits 1 s in native code."""

    def check(self, keys: list[str]) -> bool:
        if ENDED.is_set():
            IN_CALL.set()
            # Raises once the second has gone by (the launcher waited for it).
            with contextlib.suppress(Exception):
                STORE.wait([KEY], timedelta(seconds=1))
        return False


class Watch(hangwatch.HangWatch):
    def __init__(self, **kwargs: Any) -> None:
        kwargs["job_store"] = lambda: (SlowStore(), True, "manygpu-test")
        super().__init__(**kwargs)


def _agent(*args: Any, **kwargs: Any) -> int:
    code = real_agent(*args, **kwargs)
    ENDED.set()
    if IN_CALL.wait(10):
        print("manygpu-test: the hang watch is in a store call", file=sys.stderr, flush=True)
    return code


class Finalizing:
    """Freed with a module of its own as the interpreter removes the modules, once it
    has begun to finalize (not in ``__main__``, whose globals the functions patched
    into the launcher keep alive). It keeps what it needs: globals may be gone."""

    def __init__(self) -> None:
        # A client of its own: one store object runs one call at a time.
        self.client = TCPStore("127.0.0.1", STORE.port, is_master=False)
        self.server, self.key, self.sleep = STORE, KEY, time.sleep

    def __del__(self) -> None:
        self.client.set(self.key, "1")
        self.sleep(1.0)


real_agent = agent._agent
agent._agent = _agent  # type: ignore[assignment]
hangwatch.HangWatch = Watch  # type: ignore[misc]
HOLDER = types.ModuleType("manygpu_test_finalizing")
HOLDER.last = Finalizing()  # type: ignore[attr-defined]
sys.modules[HOLDER.__name__] = HOLDER
del HOLDER

if __name__ == "__main__":
    sys.exit(main())
