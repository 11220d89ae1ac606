"""Rank 1 skips a collective that rank 0 calls: the job must end, not hang."""

import os
import sys
import time

import torch

from manygpu import Parallel

with open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w") as fh:
    fh.write(str(os.getpid()))
par = Parallel(strategy="ddp")
if par.rank == 0:
    par.reduce(torch.ones(4), "sum")
else:
    time.sleep(600)  # never joins the all-reduce
