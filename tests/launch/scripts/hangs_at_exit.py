"""Finishes its work, then hangs at interpreter exit holding the GIL (rank 1 only).

An atexit handler calls libc's sleep through ``ctypes.PyDLL``, which keeps the
GIL: as stuck as gloo's destructor deadlock, and no Python watchdog can run.
A non-daemon thread that outlives the script must still be waited for.
"""

import atexit
import ctypes
import os
import sys
import threading
import time

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
out = sys.argv[1]
with open(os.path.join(out, f"pid{rank}"), "w") as fh:
    fh.write(str(os.getpid()))


def _late_write() -> None:
    time.sleep(1.5)
    with open(os.path.join(out, f"thread-{rank}"), "w") as fh:
        fh.write("done")


threading.Thread(target=_late_write).start()
if rank == 1:
    atexit.register(lambda: ctypes.PyDLL(None).sleep(600))
print(f"rank {rank} done", flush=True)
