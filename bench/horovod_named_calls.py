"""Cost of one small ``hvd.allreduce``, unnamed and named, per call (microseconds).

Every whole-job call of manygpu.horovod starts with a matching round
(manygpu/horovod/matching.py): one tiny all-gather when nothing is pending, and
for a named call the names (as JSON) too. This measures what that costs on
4 floats, where it weighs most. Run under the launcher:

    OMP_NUM_THREADS=1 manygpu launch --nproc-per-node 2 bench/horovod_named_calls.py
"""

from __future__ import annotations

import time

import torch

import manygpu.horovod as hvd

CALLS = 1000


def per_call_us(name: str | None) -> float:
    """Mean wall time of ``CALLS`` all-reduces of 4 floats, after a barrier."""
    x = torch.ones(4)
    hvd.barrier()
    start = time.perf_counter()
    for _ in range(CALLS):
        hvd.allreduce(x, name=name)
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    hvd.init()
    for _ in range(50):  # warm-up
        hvd.allreduce(torch.ones(4))
    result = {"unnamed": per_call_us(None), "named": per_call_us("m")}
    if hvd.rank() == 0:
        print({k: round(v, 1) for k, v in result.items()}, "us per call")
    hvd.shutdown()


if __name__ == "__main__":
    main()
