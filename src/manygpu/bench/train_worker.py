"""The per-rank program of ``manygpu bench train`` (started by ``manygpu launch``).

Its configuration is the :class:`~manygpu.bench.train.TrainJob` the command
built and handed over (:mod:`manygpu.runtime.handoff`). Rank 0 writes its
job's :class:`~manygpu.bench.train.RunStats` as JSON to the job's ``out``; the
command that launched the jobs assembles the scaling table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from manygpu.bench import models
from manygpu.bench.train import TrainJob, measure, parallel_fields, parallel_options
from manygpu.core.parallel import Parallel
from manygpu.errors import UsageError
from manygpu.runtime import handoff


def main(job: TrainJob) -> int:
    """Measure this job on every rank; rank 0 writes the stats."""
    cfg = job.bench
    with Parallel(**parallel_options(cfg, parallel_fields())) as par:
        if job.threads and par.device.type == "cpu":
            # The same threads per worker at every worker count: per-worker scaling.
            torch.set_num_threads(job.threads)
        torch.manual_seed(0)  # the same initial model on every rank
        workload = models.build(cfg.model, models.size_for(cfg.size, par.device.type))
        try:
            stats = measure(par, workload, cfg)
        except torch.OutOfMemoryError:
            raise UsageError(
                f"{workload.name} at batch {cfg.batch or workload.batch} per worker does not "
                f"fit in {par.device} memory; pass a smaller --batch (or --size small)"
            ) from None
        if par.is_main:
            out = Path(job.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(stats.as_dict(), indent=2))
        par.print(
            f"  {stats.workers} worker(s): {stats.samples_per_s:,.1f} samples/s "
            f"(step {stats.step_s * 1e3:.1f} ms = compute {stats.compute_s * 1e3:.1f} "
            f"+ exposed comm {stats.comm_s * 1e3:.1f} + data {stats.data_s * 1e3:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(handoff.received(TrainJob)))
