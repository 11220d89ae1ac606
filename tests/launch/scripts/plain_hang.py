"""A plain torchrun script: no manygpu, no timeout given; rank 1 never joins the all_reduce."""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(120)
dist.all_reduce(torch.ones(4))
