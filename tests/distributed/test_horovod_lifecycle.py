"""``hvd.init()`` after ``hvd.shutdown()``, many times in one process, on real gloo ranks.

Each default group used to be created under the same store keys as the one
before it (torch names every default group ``0``), so a new group could read
the old group's gloo addresses and hang or fail with "connection reset"; and
the debug call counter, keyed by the group's ``id()``, could carry over on
some ranks only. Fifty rounds make an intermittent failure near certain.
"""

from __future__ import annotations

from typing import Any

import torch
from dist_harness import preload, run_ranks

preload("manygpu.horovod")

ROUNDS = 50


def _rounds(rounds: int) -> list[Any]:
    import manygpu.horovod as hvd

    sums = []
    for i in range(rounds):
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + i)]), op=hvd.Sum)
        hvd.barrier()
        sums.append(total.item())
        hvd.shutdown()
    return [sums, hvd.is_initialized()]


def test_fifty_rounds_of_init_and_shutdown() -> None:
    world = 2
    results = run_ranks(_rounds, world, ROUNDS, timeout=120.0)
    want = [float(sum(range(world)) + world * i) for i in range(ROUNDS)]
    for sums, initialized in results:
        assert sums == want
        assert initialized is False
