"""One host's share of a cross-host run: train under each STRATEGY, save full parameters per rank.

Usage: OUT_DIR STEPS BATCH STRATEGY[,STRATEGY...]. Each rank trains a fresh
model on its slice of the same global batches as tests/helpers/reference.py's
one-process loop, once per strategy, in one job (one start-up of every host
for all of them), and writes OUT_DIR/STRATEGY-rankR.pt.
"""

import os
import sys

import torch
from reference import make_data, make_model
from torch import nn

from manygpu import Parallel

out_dir, steps, batch, strategies = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4].split(","),
)


def train(par: Parallel) -> None:
    """Train one fresh model under ``par``'s strategy and record its full parameters."""
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
    torch.save(record, os.path.join(out_dir, f"{par.strategy_name}-rank{par.rank}.pt"))
    print(f"rank {par.rank} of {par.world_size} done ({par.strategy_name})", flush=True)


# The first Parallel creates the process group; the later ones join it.
with Parallel(strategy=strategies[0], timeout_s=60) as first:
    train(first)
    for strategy in strategies[1:]:
        with Parallel(strategy=strategy, timeout_s=60) as par:
            train(par)
