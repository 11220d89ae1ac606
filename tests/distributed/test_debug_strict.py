"""MANYGPU_DEBUG=strict on real gloo ranks: a skipped call is caught at the call itself.

Rank 1 skips the first of two all-reduces of one shape. With ``MANYGPU_DEBUG=1``
its second call meets rank 0's first (same operation, shape and call number),
both ranks get a wrong sum (100 + 110 = 210 instead of 300), and only the end
of the job tells. Strict mode compares the call sites too and stops both ranks
at the first call, before any data moves.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import torch
from dist_harness import preload, run_ranks

preload("manygpu.horovod")

HERE = Path(__file__).name


def _skip_first_reduce() -> dict[str, Any]:
    from manygpu import Parallel
    from manygpu.comm import CollectiveMismatchError

    par = Parallel(strategy="ddp", timeout_s=20)
    r, got, stage = par.rank, [], "first"
    try:
        try:
            if r == 0:
                got.append(par.reduce(torch.tensor([100.0 * (r + 1)]), "sum").item())  # site A
            stage = "second"
            got.append(par.reduce(torch.tensor([10.0 + 100.0 * r]), "sum").item())  # site B
            stage = "close"
            par.close()
        except CollectiveMismatchError as exc:
            return {"stage": stage, "got": got, "error": str(exc)}
        return {"stage": "done", "got": got, "error": ""}
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _skip_first_allreduce() -> dict[str, Any]:
    import manygpu.horovod as hvd

    hvd.init()
    got: list[float] = []
    try:
        r = hvd.rank()
        try:
            if r == 0:
                got.append(hvd.allreduce(torch.tensor([100.0]), op=hvd.Sum).item())  # site A
            got.append(hvd.allreduce(torch.tensor([10.0 + 100 * r]), op=hvd.Sum).item())  # site B
        except hvd.HorovodMismatchError as exc:
            return {"got": got, "error": str(exc)}
        return {"got": got, "error": ""}
    finally:
        hvd.shutdown()


def _sites(fn: Any) -> tuple[str, str]:
    """``test_debug_strict.py:N`` of the lines marked ``site A`` and ``site B`` in ``fn``."""
    lines, first = inspect.getsourcelines(fn)
    where = {
        mark: f"{HERE}:{first + i}"
        for i, line in enumerate(lines)
        for mark in ("A", "B")
        if line.rstrip().endswith(f"# site {mark}")
    }
    return where["A"], where["B"]


def test_strict_mode_stops_a_skipped_reduce_at_the_call() -> None:
    a, b = _sites(_skip_first_reduce)
    results = run_ranks(_skip_first_reduce, 2, extra_env={"MANYGPU_DEBUG": "strict"})
    assert [res["stage"] for res in results] == ["first", "second"]
    for r, res in enumerate(results):
        assert res["got"] == [], "no rank may return a sum"
        message = res["error"]
        assert "\n" not in message
        assert message.startswith(f"rank {r}: collective mismatch (MANYGPU_DEBUG=strict"), message
        assert f"rank 0 calls all_reduce(float32[1], arg=0) at {a} as call #" in message, message
        assert f"rank 1 calls all_reduce(float32[1], arg=0) at {b} as call #" in message, message
        assert "different lines" in message


def test_default_debug_level_still_reports_the_skip_only_at_close() -> None:
    results = run_ranks(_skip_first_reduce, 2, extra_env={"MANYGPU_DEBUG": "1"})
    # The known weakness strict mode exists for: both ranks used 100 + 110.
    assert [res["got"] for res in results] == [[210.0], [210.0]]
    assert [res["stage"] for res in results] == ["second", "close"]
    for res in results:
        assert "collective mismatch:" in res["error"] and "end of the job" in res["error"]


def test_strict_mode_stops_a_skipped_horovod_allreduce() -> None:
    a, b = _sites(_skip_first_allreduce)
    results = run_ranks(_skip_first_allreduce, 2, extra_env={"MANYGPU_DEBUG": "strict"})
    for res in results:
        assert res["got"] == [], "no rank may return a sum"
        message = res["error"]
        assert re.search(rf"rank 0 calls all_reduce\(float32\[1\], arg=\d+\) at {a}", message)
        assert re.search(rf"rank 1 calls all_reduce\(float32\[1\], arg=\d+\) at {b}", message)
