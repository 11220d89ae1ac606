"""A DDP training job where a rank may be slow; argv: KIND STEPS EVERY OUT.

``uniform``: nobody is slow; ``compute``: the last rank sleeps 50 ms in every
forward; ``input``: the last rank's loader sleeps 50 ms per batch; ``mixed``:
both at once, the last rank computing slowly and rank 1 reading slowly; ``network``:
nobody is slow on its own (the test throttles one host's link). The uniform and
network jobs train a wider model: gradients that load the link. Every rank of the
uniform job spends the same 40 ms in each forward (a sleep: equal work that costs no
CPU, so the suite's other tests keep the cores), which makes 200 steps outlast a
straggler verdict's 5 s. The main rank writes OUT/steps-KIND.json: its final
``par.step_times``.

Several kinds one after the other in one start of the ranks (each process costs
seconds of CPU): KIND and STEPS comma-separated (``uniform,mixed 200,160``). Each
kind trains a fresh model under its own ``Parallel`` (its own reports and judge) on
the one process group this script makes, and once every rank is done with it the
main rank prints ``straggler_kinds: KIND done`` on stderr, after its verdicts.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from manygpu import Parallel

kinds, every, out = sys.argv[1].split(","), int(sys.argv[3]), sys.argv[4]
all_steps = [int(n) for n in sys.argv[2].split(",")]
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
kind = kinds[0]
slow_compute = slow_input = False


def become(now: str) -> None:
    """This rank's part in kind ``now``."""
    global kind, slow_compute, slow_input
    kind = now
    slow_compute = kind in ("compute", "mixed") and rank == world - 1
    slow_input = (kind == "input" and rank == world - 1) or (kind == "mixed" and rank == 1)


class Blocks(nn.Module):
    """A small residual MLP (ModuleList of blocks); wide when the network is the test."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if slow_compute:
            time.sleep(0.05)
        elif kind == "uniform":
            time.sleep(0.04)
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.head(x)


class Points(Dataset):
    def __init__(self, width: int) -> None:
        self.x = torch.randn(4096 + 13, width)  # does not divide evenly
        self.y = torch.randint(0, 4, (len(self.x),))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The culprit's batches each take 50 ms to arrive (a slow disk or decoder)."""
    if slow_input:
        time.sleep(0.05)
    return [torch.stack(column) for column in zip(*items, strict=True)]


def train(steps: int) -> None:
    """``steps`` steps of this kind under a ``Parallel`` of its own; the main rank
    writes its last reports' table."""
    width = 256 if kind == "network" else 64
    par = Parallel(strategy="ddp", stragglers=every)
    model = Blocks(width, 4)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0}], lr=1e-3)
    batch = 8
    loader = DataLoader(Points(width), batch_size=batch, shuffle=True, collate_fn=collate)
    model, opt, loader = par.prepare(model, opt, loader)
    done = 0
    while done < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            par.backward(loss)
            par.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                break
    par.close()  # the main rank judges the last window before it returns
    if par.is_main:
        with open(os.path.join(out, f"steps-{kind}.json"), "w") as fh:
            json.dump(par.step_times, fh)


if len(kinds) > 1:
    dist.init_process_group("gloo")  # outlives each kind's Parallel
for now, steps in zip(kinds, all_steps, strict=True):
    become(now)
    train(steps)
    if len(kinds) > 1:
        dist.barrier()  # every rank's last window is in before the next kind's first
        if rank == 0:
            print(f"straggler_kinds: {now} done", file=sys.stderr, flush=True)
if len(kinds) > 1:
    dist.destroy_process_group()
