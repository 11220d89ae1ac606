"""Trains briefly and returns, leaving what makes a finished job hang if exit is
not done as Python does it: an idle, non-daemon thread pool held by a module.

argv: OUT, MODES (comma-separated). ``pool``: our own ThreadPoolExecutor kept
in ``sys.modules`` (OUT/pool<rank> says it was made); ``compile``:
``Parallel(compile=True)`` (inductor's async compile keeps its pool; run with an
empty TORCHINDUCTOR_CACHE_DIR); ``cycle``: a file written but never closed,
reachable only through a reference cycle at exit (Python's last collection
flushes it: OUT/cycle<rank>), and OUT/frozen<rank>, how many objects the worker
froze out of the collector when torch loaded. Writes OUT/pid<rank> and OUT/done<rank>.
"""

import gc
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from manygpu import Parallel


class Net(nn.Module):
    """Its own forward (dynamo compiles nothing for a bare nn.Sequential here)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


out, modes = sys.argv[1], sys.argv[2].split(",")
with Parallel(strategy="ddp", compile="compile" in modes) as par:
    with open(os.path.join(out, f"pid{par.rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    model = Net()
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        x = torch.randn(4, 8)
        par.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    if "pool" in modes:
        pool = ThreadPoolExecutor(2)
        sys.modules["_held_pool"] = pool  # type: ignore[assignment]  # as a library holds one
        assert pool.submit(lambda: 1).result() == 1
        with open(os.path.join(out, f"pool{par.rank}"), "w") as fh:
            fh.write("held")
    if "cycle" in modes:
        # The optimizer loaded torch._dynamo, with the collector paused only meanwhile.
        assert gc.isenabled() and "torch._dynamo" in sys.modules
        with open(os.path.join(out, f"frozen{par.rank}"), "w") as fh:
            fh.write(str(gc.get_freeze_count()))
        holder = type("Holder", (), {})()
        holder.me = holder
        holder.log = open(os.path.join(out, f"cycle{par.rank}"), "w")  # noqa: SIM115
        holder.log.write("flushed at exit")
    with open(os.path.join(out, f"done{par.rank}"), "w") as fh:
        fh.write("ok")
