"""``hvd.init()`` / allreduce / barrier / ``hvd.shutdown()`` N times; prints each round's sum."""

from __future__ import annotations

import sys

import torch

import manygpu.horovod as hvd

for i in range(int(sys.argv[1])):
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + i)]), op=hvd.Sum)
    hvd.barrier()
    if hvd.rank() == 0:
        print(f"round {i} sum {total.item():g}", flush=True)
    hvd.shutdown()
