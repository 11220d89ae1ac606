"""Run STEPS steps of about STEP_S seconds, each an all-reduce across the job, leaving marks in OUT.

Usage: OUT STEPS STEP_S [NAME ...]. Writes OUT/started-<rank> after the first
step (the job is running on every host): JSON of this rank's address and of the
variables NAME... it sees; OUT/done-<rank>-<world> at the end. An elastic
restart starts over with the new world size.

Plain torch.distributed, not a model under DDP: what the tests that use it check
is the launcher (a stop, a lost host), and a rank waiting in a gloo collective
(where a signal's Python handler cannot run) is the case a training step makes;
DDP's imports would cost each rank about a second of CPU more.
"""

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

out, steps, step_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
grads = torch.ones(64)
for step in range(steps):
    dist.all_reduce(grads)  # what a DDP step does across the hosts
    grads.div_(world)
    if step == 0:
        print(f"rank {rank} of {world} is training", flush=True)
        # This host's address: its namespace's eth0 (MASTER_ADDR is the
        # node's door to the job's store, on loopback).
        addr = next(a.address for a in psutil.net_if_addrs()["eth0"] if a.family == socket.AF_INET)
        seen = {name: os.environ.get(name) for name in sys.argv[4:]}
        (out / f"started-{rank}").write_text(json.dumps({"addr": addr, "env": seen}))
    time.sleep(step_s)
(out / f"done-{rank}-{world}").write_text("")
dist.destroy_process_group()
