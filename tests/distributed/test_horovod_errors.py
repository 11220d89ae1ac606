"""manygpu.horovod's errors on real gloo ranks: mismatches name the ranks, a stall the missing.

One job of 3 ranks with a 4 s collective timeout makes every mistake in turn
(different shapes, different names, different models, different parameter
sets), checks that the job is still usable after each, and ends with a stall:
rank 2 never calls the last all-reduce.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from dist_harness import away_until_marked, mark, preload, run_ranks
from torch import nn

preload("manygpu.horovod")

TIMEOUT_S = 4


def _catch(fn: Any) -> str:
    import manygpu.horovod as hvd

    try:
        fn()
    except hvd.HorovodMismatchError as exc:
        return str(exc)
    return "no error"


def _mistakes(marks: str) -> dict[str, Any]:
    import manygpu.horovod as hvd
    from manygpu.errors import CollectiveTimeoutError

    hvd.init()
    try:
        r = hvd.rank()
        out: dict[str, Any] = {}
        out["shape"] = _catch(lambda: hvd.allreduce(torch.ones(8 if r == 1 else 4), name="x"))
        out["name"] = _catch(lambda: hvd.allreduce(torch.ones(4), name="b" if r == 2 else "a"))
        out["op"] = _catch(lambda: hvd.allreduce(torch.ones(4), op=hvd.Max if r else hvd.Min))
        model = nn.Linear(5, 9 if r == 1 else 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out["optimizer"] = _catch(
            lambda: hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        )
        params = {"w": torch.ones(2)} | ({"extra": torch.ones(1)} if r != 2 else {})
        out["params"] = _catch(lambda: hvd.broadcast_parameters(params, root_rank=0))
        out["after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()  # still usable
        if r == 2:  # never calls the next collective (until ranks 0 and 1 gave up on it)
            away_until_marked(marks, 2, 3 * TIMEOUT_S)
            return out
        start = time.monotonic()
        try:
            hvd.allreduce(torch.ones(3), name="stuck")
            out["stall"] = "no error"
        except CollectiveTimeoutError as exc:
            out["stall"] = str(exc)
        out["stall_s"] = time.monotonic() - start
        mark(marks, r)
        return out
    finally:
        hvd.shutdown()


def test_mismatches_and_stalls_name_the_ranks(tmp_path: Path) -> None:
    results = run_ranks(
        _mistakes, 3, str(tmp_path), timeout=120, extra_env={"MANYGPU_TIMEOUT": str(TIMEOUT_S)}
    )
    for r, out in enumerate(results):
        assert (
            f"rank {r}: manygpu.horovod: ranks disagree on a collective: "
            "ranks 0, 2 call allreduce('x', float32[4], op=Average); "
            "rank 1 calls allreduce('x', float32[8], op=Average)"
        ) in out["shape"], out["shape"]
        assert "ranks 0, 1 call allreduce('a', float32[4]" in out["name"], out["name"]
        assert "rank 2 calls allreduce('b', float32[4]" in out["name"], out["name"]
        assert "op=Min" in out["op"] and "ranks 1, 2 call" in out["op"], out["op"]
        assert (
            "'weight' is float32[8x5] on ranks 0, 2, float32[9x5] on rank 1" in out["optimizer"]
        ), out["optimizer"]
        assert "'bias' is float32[8] on ranks 0, 2, float32[9] on rank 1" in out["optimizer"]
        assert "'extra' exists only on ranks 0, 1" in out["params"], out["params"]
        assert out["after"] == 3.0
    for r in (0, 1):
        stall = results[r]["stall"]
        assert stall.startswith(
            f"rank {r}: allreduce('stuck', float32[3], op=Average) did not complete within "
            f"{TIMEOUT_S}s"
        ), stall
        assert "missing ranks: [2] never started this collective" in stall, stall
        assert "ranks 0, 1 waited in it" in stall, stall
        assert results[r]["stall_s"] < 4 * TIMEOUT_S
