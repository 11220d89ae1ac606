"""One node's share of a cross-host DDP run: train, then save parameters per rank.

With a fourth argument ``wait``: after ``prepare``, write OUT/ready<rank> and
wait for OUT/go (at most 120 s), so a test can act while the job is up.
"""

import os
import sys
import time
from pathlib import Path

import torch
from reference import flat_params, make_data, make_model
from torch import nn

from manygpu import Parallel

out_dir, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with Parallel(strategy="ddp", timeout_s=60) as par:
    model = make_model()
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if sys.argv[4:] == ["wait"]:
        (Path(out_dir) / f"ready{par.rank}").touch()
        deadline = time.monotonic() + 120
        while not (Path(out_dir) / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    per = batch // par.world_size
    x, y = make_data(steps * batch)
    for step in range(steps):
        start = step * batch + par.rank * per
        par.backward(nn.functional.mse_loss(model(x[start : start + per]), y[start : start + per]))
        opt.step()
        opt.zero_grad()
    record = {
        "params": flat_params(par.unwrap(model)),
        "master_addr": os.environ["MASTER_ADDR"],
        "world": par.world_size,
        "node": int(os.environ["GROUP_RANK"]),
    }
    torch.save(record, os.path.join(out_dir, f"rank{par.rank}.pt"))
