"""Rank 1 fails (exception or exit code); rank 0 waits in a barrier and gets stopped."""

import os
import sys
import time

mode = sys.argv[1]
rank = int(os.environ["RANK"])
with open(os.path.join(sys.argv[2], f"pid{rank}"), "w") as fh:
    fh.write(str(os.getpid()))
if rank == 1:
    time.sleep(0.5)
    if mode == "raise":
        raise ValueError("boom from the failing rank")
    sys.exit(int(mode))
time.sleep(120)
