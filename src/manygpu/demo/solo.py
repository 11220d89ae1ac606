"""One worker training alone: the baseline each of the demo's timing windows compares with."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from manygpu.core.parallel import Parallel
from manygpu.demo.model import SimpleCNN

WARMUP_STEPS = 3
"""Untimed first steps (allocator, kernels), once, when the baseline is built."""


def _forever(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches without end (reshuffled each pass)."""
    while True:
        yield from loader


class SoloWorker:
    """A model of its own trained on the main process, one window at a time.

    It runs while the other workers wait at a collective, so it has exactly the
    CPU share (threads, device) one worker of the job had. It is built once and
    warmed up once, so every window times steady-state steps.
    """

    def __init__(self, par: Parallel, dataset: TensorDataset, batch: int, image_size: int) -> None:
        self.par = par
        self.batch = batch
        self.model = SimpleCNN(image_size).to(par.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        loader = DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True)
        self._batches = _forever(loader)
        self._steps(WARMUP_STEPS)

    def _steps(self, steps: int) -> None:
        for _ in range(steps):
            x, y = next(self._batches)
            x, y = x.to(self.par.device), y.to(self.par.device)
            with self.par.autocast():
                loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        if self.par.device.type == "cuda":
            torch.cuda.synchronize()

    def rate(self, steps: int) -> float:
        """Samples/s over ``steps`` training steps."""
        start = time.perf_counter()
        self._steps(steps)
        return steps * self.batch / (time.perf_counter() - start)


def window_rate(par: Parallel, solo: SoloWorker | None, steps: int) -> float:
    """One worker's samples/s on every rank: the main process times, the others wait.

    Called by every rank together; the reduce both hands the main process's
    number to all and holds the others back until it is measured.
    """
    rate = solo.rate(steps) if solo is not None else 0.0
    return float(par.reduce(torch.tensor([rate]), "max"))
