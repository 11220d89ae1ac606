"""The memory-cap helper caps for real: over the cap is stopped, under it runs."""

from __future__ import annotations

import sys

import memlimit
import pytest

ALLOC = "b = bytearray({mb} << 20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
CAP = 96 << 20


@pytest.mark.slow  # starts Python processes (without torch: ~0.1 s each)
def test_a_process_over_the_cap_is_stopped_and_one_under_it_runs() -> None:
    kind, _ = memlimit.best()
    cap = CAP if kind != "rlimit_as" else 256 << 20  # virtual space: the interpreter's own
    over = memlimit.run_capped([sys.executable, "-c", ALLOC.format(mb=300)], cap, timeout=60)
    assert over.done.returncode != 0 and "ok" not in over.done.stdout, over
    under = memlimit.run_capped([sys.executable, "-c", ALLOC.format(mb=20)], cap, timeout=60)
    assert under.done.returncode == 0 and under.done.stdout.strip() == "ok", under
    if kind != "rlimit_as":
        assert over.done.returncode == -9  # the cgroup's OOM killer
        assert under.peak_bytes is not None and (20 << 20) < under.peak_bytes <= cap


@pytest.mark.slow
def test_rlimit_as_is_there_as_a_last_resort() -> None:
    over = memlimit.run_capped(
        [sys.executable, "-c", ALLOC.format(mb=600)], 512 << 20, kind="rlimit_as", timeout=60
    )
    assert over.kind == "rlimit_as" and over.done.returncode == 1
    assert "MemoryError" in over.done.stderr


def test_says_which_mechanism_or_why_none() -> None:
    kind, parent = memlimit.best()
    assert kind in ("cgroup2", "cgroup1", "rlimit_as")
    assert (parent is None) == (kind == "rlimit_as")
    assert (memlimit.why_not_cgroup() == "") == (kind != "rlimit_as")
