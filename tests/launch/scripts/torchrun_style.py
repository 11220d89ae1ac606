"""A plain torchrun script: reads only torchrun's variables, no manygpu import."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
keys = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "OMP_NUM_THREADS",
)
record = {k: os.environ.get(k) for k in keys} | {"sum": t.item(), "argv": sys.argv[1:]}
record["file"] = __file__
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
    json.dump(record, fh)
dist.destroy_process_group()
