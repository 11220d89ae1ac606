"""``manygpu.ray.run``'s refusals, before any Ray process starts."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("ray", reason="Ray Train is not installed (pip install 'manygpu[ray]')")

import manygpu.ray
from manygpu import UsageError


def test_a_missing_script_or_a_bad_worker_count_is_one_line() -> None:
    with pytest.raises(UsageError, match=r"no script at no-such-train\.py"):
        manygpu.ray.run("no-such-train.py", num_workers=2)
    for bad in (0, (3, 2), (0, 2), (2,), [2, 4], True):
        with pytest.raises(
            UsageError,
            match=r"num_workers must be an integer >= 1 or a \(min, "
            rf"max\) pair with 1 <= min <= max, got {re.escape(repr(bad))}$",
        ):
            manygpu.ray.run(print, num_workers=bad)  # type: ignore[arg-type]
    manygpu.ray.check_workers((2, 4))
    manygpu.ray.check_workers((3, 3))


def test_outside_ray_nothing_is_reported_and_nothing_restored() -> None:
    from manygpu.runtime import ray_train

    assert not ray_train.active()
    ray_train.report_checkpoint(3, "/nowhere")  # a no-op outside a Ray Train worker
    assert ray_train.restored_checkpoint() is None
