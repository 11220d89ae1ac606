"""One host's share of a cross-host run under STRATEGY: train, then save full parameters per rank.

Usage: OUT_DIR STEPS BATCH STRATEGY. Each rank trains on its slice of the same
global batches as tests/helpers/reference.py's one-process loop.
"""

import os
import sys

import torch
from reference import make_data, make_model
from torch import nn

from manygpu import Parallel

out_dir, steps, batch, strategy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with Parallel(strategy=strategy, timeout_s=60) as par:
    model = par.prepare(make_model())  # shard first: the optimizer must see the shards
    opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    per = batch // par.world_size
    x, y = make_data(steps * batch)
    for step in range(steps):
        start = step * batch + par.rank * per
        par.backward(nn.functional.mse_loss(model(x[start : start + per]), y[start : start + per]))
        opt.step()
        opt.zero_grad()
    # DTensor shards (fsdp) made whole: every rank records the full parameters.
    params = torch.cat(
        [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
            for p in par.unwrap(model).parameters()
        ]
    )
    record = {
        "params": params,
        "world": par.world_size,
        "strategy": par.strategy_name,
        "master_addr": os.environ["MASTER_ADDR"],
        "host": os.uname().nodename,
        "node": int(os.environ["GROUP_RANK"]),
    }
    torch.save(record, os.path.join(out_dir, f"rank{par.rank}.pt"))
    print(f"rank {par.rank} of {par.world_size} done", flush=True)
