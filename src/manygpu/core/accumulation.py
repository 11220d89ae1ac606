"""Gradient-accumulation bookkeeping: which micro-step synchronises."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class Accumulator:
    """Counts micro-steps; every ``steps``-th one (or a forced one) is a boundary.

    The decision for a micro-step must be known *before* its forward, because
    DDP decides at forward time whether the coming backward all-reduces.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.micro = 0
        self._force = False
        self.last_synced = True
        self.last_cycle = 0
        """Micro-steps in the cycle the last boundary ended (< steps when cut short)."""

    @property
    def next_is_boundary(self) -> bool:
        """Whether the coming backward ends an accumulation cycle."""
        return self._force or (self.micro + 1) % self.steps == 0

    def force_boundary(self) -> None:
        """End the cycle at the coming backward (the loader's last batch)."""
        self._force = True

    def advance(self) -> bool:
        """Record one backward; returns whether it was a boundary."""
        boundary = self.next_is_boundary
        if boundary:
            self.last_cycle = self.micro + 1
        self.micro = 0 if boundary else self.micro + 1
        self._force = False
        self.last_synced = boundary
        return boundary


def reweight_short_cycle(models: Iterable[nn.Module], steps: int, had: int) -> None:
    """Make a cycle cut short (the epoch's last batches) a mean over its own micro-batches.

    Each micro-batch's loss was divided by ``steps`` (``grad_accum_steps``)
    before its backward; a cycle of only ``had`` micro-batches would then weigh
    its batches had/steps as much as a full one (a lone last micro-batch would
    count half at steps=2). Scaling the summed gradients by steps/had is the
    mean over what the cycle really had, as one process would compute on those
    batches.
    """
    if had >= steps:
        return
    factor = steps / had
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
