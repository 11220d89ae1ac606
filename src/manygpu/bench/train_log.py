"""``bench train --log-with``: every timed normal step, sent to the job's trackers.

Each block's steps are logged after the block, outside its timing: ``par.log``
is a collective, and inside a timed step its round trip would be measured as
part of the step. Warm-up and the no-sync steps (there only to split the step)
are not logged. Per step: loss, learning rate, step time, the job's samples/s
at that step time (the global batch over this rank's step, averaged over ranks,
as the benchmark's own figure counts it) and MFU where the benchmark computes
it (a known peak). ``par.log`` adds its own wall-clock samples/s
(``throughput/samples_per_s``) on the first step of each block; with several
workers its interval also holds the no-sync block before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from manygpu.bench.mfu import mfu

if TYPE_CHECKING:
    from manygpu.core.parallel import Parallel


class StepLog:
    """Numbers the logged steps 1, 2, ... over the blocks of one job."""

    def __init__(self, par: Parallel, *, global_batch: int, flops: int, peak: float | None) -> None:
        self.par, self.global_batch, self.flops, self.peak = par, global_batch, flops, peak
        self.enabled = bool(par.config.log_with)
        self.step = 0

    def block(
        self, opt: torch.optim.Optimizer, step_s: list[float], losses: list[torch.Tensor]
    ) -> None:
        """Log one block's steps (every rank calls it: ``par.log`` is collective)."""
        if not self.enabled:
            return
        lr = float(opt.param_groups[0]["lr"])
        for seconds, loss in zip(step_s, losses, strict=True):
            self.step += 1
            values: dict[str, float | torch.Tensor] = {
                "loss": loss,
                "lr": lr,
                "step_s": seconds,
                "samples_per_s": self.global_batch / seconds,
            }
            achieved = mfu(self.flops, 1.0 / seconds, self.peak)
            if achieved is not None:  # the same on every rank: the keys agree
                values["mfu"] = achieved
            self.par.log(values, step=self.step)
