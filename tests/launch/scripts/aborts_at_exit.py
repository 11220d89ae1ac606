"""Finishes its work, then dies in the interpreter's shutdown (SIGABRT).

A daemon thread keeps calling a store (native code that releases the GIL).
Python 3.11 ends a daemon thread that comes back from native code while the
interpreter finalizes with ``pthread_exit``; its unwinding through torch's GIL
guard (a ``noexcept`` destructor) calls ``std::terminate``: "terminate called
without an active exception", every time.
"""

import datetime
import os
import sys
import threading

import torch.distributed as dist

out = sys.argv[1]
with open(os.path.join(out, "pid0"), "w") as fh:
    fh.write(str(os.getpid()))
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))


def _keep_calling() -> None:
    while True:
        store.set("key", "value")
        store.get("key")


threading.Thread(target=_keep_calling, daemon=True).start()
with open(os.path.join(out, "done0"), "w") as fh:
    fh.write("done")
