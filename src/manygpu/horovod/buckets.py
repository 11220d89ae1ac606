"""Which gradients travel together: the DistributedOptimizer's buckets, as pure functions.

One all-reduce per parameter costs a latency each; one for the whole model
cannot start before the last gradient exists. Buckets of about 25 MiB, taken
in the reverse of the parameters' order (gradients appear roughly from the
last layer to the first), are launched as soon as they are full, so the
first buckets travel while backward still computes the others; the first
bucket is small (1 MiB) so that communication starts early. This is what
Horovod's tensor fusion and DDP's buckets do; Horovod's explicit ``groups``
and ``num_groups`` choose the buckets instead.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

MIB = 1 << 20
DEFAULT_CAP_MB = 25.0
FIRST_CAP_MB = 1.0


def plan_buckets(
    nbytes: Sequence[int],
    keys: Sequence[Hashable],
    *,
    cap_bytes: int,
    first_cap_bytes: int | None = None,
) -> list[list[int]]:
    """Consecutive indices into buckets of at most ``cap_bytes`` (one item may exceed it).

    A bucket also ends where ``keys`` (device and dtype) change: a bucket is
    one flat tensor.
    """
    if len(nbytes) != len(keys):
        raise ValueError("plan_buckets: one key per size")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, (size, key) in enumerate(zip(nbytes, keys, strict=True)):
        cap = first_cap_bytes if not buckets and first_cap_bytes is not None else cap_bytes
        if current and (key != keys[current[-1]] or filled + size > cap):
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
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
