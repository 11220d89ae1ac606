"""Which gradients travel together: the DistributedOptimizer's buckets, as pure functions.

One all-reduce per parameter costs a latency each; one for the whole model
cannot start before the last gradient exists. Buckets of 25 MiB, taken in
the reverse of the parameters' order (gradients appear roughly from the last
layer to the first), are launched as soon as they are full, so the first
buckets travel while backward still computes the others. This is what
Horovod's tensor fusion and DDP's buckets do; Horovod's explicit ``groups``
and ``num_groups`` choose the buckets instead.

The buckets are the ones manygpu's ``ddp`` strategy gets from DDP: one cap
for every bucket (it passes ``bucket_cap_mb``, which turns off torch's 1 MiB
first bucket), and a bucket closes once it reaches the cap, with the
gradient that reached it. Each extra all-reduce costs 2(N-1) messages of
latency: on 4 emulated hosts at 1 Gbit/s (2 shared cores) a 1 MiB first
bucket split a 1.3 MB model into two all-reduces and cost 8-10% of the
throughput against DDP's one (BENCHMARKS.md, "Horovod's API").
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

MIB = 1 << 20
DEFAULT_CAP_MB = 25.0


def plan_buckets(
    nbytes: Sequence[int], keys: Sequence[Hashable], *, cap_bytes: int
) -> list[list[int]]:
    """Consecutive indices into buckets, each closed once it holds ``cap_bytes``
    (the item that reached the cap included, as DDP's buckets).

    A bucket also ends where ``keys`` (device and dtype) change: a bucket is
    one flat tensor.
    """
    if len(nbytes) != len(keys):
        raise ValueError("plan_buckets: one key per size")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, (size, key) in enumerate(zip(nbytes, keys, strict=True)):
        if current and key != keys[current[-1]]:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def split_even(count: int, groups: int) -> list[list[int]]:
    """``range(count)`` cut into ``groups`` consecutive parts of near-equal length."""
    groups = max(1, min(groups, count))
    base, extra = divmod(count, groups)
    out, start = [], 0
    for g in range(groups):
        n = base + (1 if g < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return [part for part in out if part]
