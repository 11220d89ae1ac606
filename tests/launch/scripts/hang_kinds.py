"""A job where rank 1 (the last rank with ``last``) stops the others from moving, in one of
several ways; argv: KIND OUT. Every rank writes OUT/pid<rank>.

``spin``: Python code that never returns, in save_checkpoint(); ``loader``: a
DataLoader worker that sleeps in __getitem__; ``stop``: SIGSTOP; ``native``:
libc sleep holding the GIL, again after a signal; ``shape``: a plain all_reduce
with another shape; ``ddp_skip``: one step of a DDP loop without its gradient
all-reduce (no_sync), then the end-of-training barrier.
"""

import ctypes
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

kind, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
culprit = world - 1
with open(os.path.join(out, f"pid{rank}"), "w") as fh:
    fh.write(str(os.getpid()))


def save_checkpoint() -> None:
    while True:  # spins in Python, never reaches the next collective
        time.sleep(0.01)


class Slow(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if rank == culprit and i >= 8:
            time.sleep(3600)
        return torch.full((4,), float(i))


t = torch.ones(16)
dist.all_reduce(t)
if kind == "ddp_skip":
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(8, 4)
        if rank == culprit and step == 2:
            with model.no_sync():  # this rank's gradients are not all-reduced this step
                model(x).sum().backward()
        else:
            model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    sys.exit(0)
if kind == "loader":
    for batch in DataLoader(Slow(), batch_size=4, num_workers=2):
        dist.all_reduce(batch)
if rank == culprit:
    if kind == "spin":
        save_checkpoint()
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "native":
        libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held in its calls
        while True:  # a signal ends a sleep early: the launcher's SIGUSR2 asks for a stack
            libc.sleep(3600)
    elif kind == "shape":
        t = torch.ones(8)
dist.all_reduce(t)
