"""Train for STEPS steps of about STEP_S seconds (ddp, tiny model), leaving marks in OUT.

Usage: OUT STEPS STEP_S [NAME ...]. Writes OUT/started-<rank> after the first
step (the job is running on every host): JSON of this rank's address and of the
variables NAME... it sees; OUT/done-<rank>-<world> at the end. An elastic
restart starts over with the new world size.
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

import psutil
import torch
from reference import make_data, make_model
from torch import nn

from manygpu import Parallel

out, steps, step_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
with Parallel(strategy="ddp", timeout_s=60) as par:
    model = make_model()
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = make_data(8)
    for step in range(steps):
        par.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if step == 0:
            print(f"rank {par.rank} of {par.world_size} is training", flush=True)
            # This host's address: its namespace's eth0 (MASTER_ADDR is the
            # node's door to the job's store, on loopback).
            addr = next(
                a.address for a in psutil.net_if_addrs()["eth0"] if a.family == socket.AF_INET
            )
            seen = {name: os.environ.get(name) for name in sys.argv[4:]}
            (out / f"started-{par.rank}").write_text(json.dumps({"addr": addr, "env": seen}))
        time.sleep(step_s)
    (out / f"done-{par.rank}-{par.world_size}").write_text("")
