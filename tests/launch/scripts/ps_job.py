"""A parameter-server job for the launch tests: ``manygpu launch --ps 1 ps_job.py OUT MODE STEPS``.

Every rank writes ``pid<rank>``; workers write ``started<rank>`` after a few
steps (the test kills a rank then) and ``done<rank>`` with their step count at
the end. Each step sleeps, so the job lasts long enough to be killed.
"""

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from manygpu import PS, Parallel

out, mode, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rank = int(os.environ["RANK"])
(out / f"pid{rank}").write_text(str(os.getpid()))
with Parallel(strategy=PS(mode=mode), timeout_s=30) as par:
    model = nn.Linear(8, 1)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    gen = torch.Generator().manual_seed(par.rank)
    for step in range(steps):
        x = torch.randn(16, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        par.backward(loss)
        opt.step()
        opt.zero_grad()
        if step == 3:
            (out / f"started{rank}").write_text("")
        time.sleep(0.1)
    (out / f"done{rank}").write_text(str(steps))
