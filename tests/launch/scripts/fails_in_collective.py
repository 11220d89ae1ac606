"""Rank FAILING fails (raise, sys.exit(N) or SIGKILL) while the others wait in a collective.

The others then fail too (their collective loses its peer): the launcher must
blame FAILING, the first failure in time, and exit with its code.
"""

import os
import signal
import sys

import torch

from manygpu import Parallel

mode, failing = sys.argv[1], int(sys.argv[2])
par = Parallel(strategy="ddp")
par.reduce(torch.ones(1))  # everyone is up
if par.rank == failing:
    if mode == "raise":
        raise ValueError(f"boom from rank {failing}")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(mode))
par.reduce(torch.ones(1))  # never completes: the failing rank is gone
par.close()
