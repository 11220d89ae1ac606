"""manygpu.comm on real gloo ranks: every collective, uneven sizes, debug mode."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from dist_harness import run_ranks

from manygpu import CollectiveTimeoutError, Parallel, comm


def _all_ops() -> dict[str, Any]:
    par = Parallel(strategy="ddp", timeout_s=30)
    try:
        r, n = par.rank, par.world_size
        out: dict[str, Any] = {}
        out["all_reduce_max"] = comm.all_reduce(torch.tensor([r, -r]), "max").tolist()
        out["all_reduce_mean_int"] = comm.all_reduce(torch.tensor([r * 3]), "mean").tolist()
        red = comm.reduce(torch.tensor([float(r + 1)]), dst=1, op="sum")
        out["reduce_on_dst"] = red.tolist() if r == 1 else None
        out["broadcast"] = comm.broadcast(torch.tensor([r * 10.0]), src=2).tolist()
        out["all_gather"] = comm.all_gather(torch.tensor([[r, r]])).tolist()
        uneven = comm.all_gather_uneven(torch.full((r,), float(r)))
        out["uneven"] = [t.tolist() for t in uneven]
        # reduce_scatter: rank r gets row r of the sum of every rank's (n x 2) input.
        rs_in = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + r
        out["reduce_scatter"] = comm.reduce_scatter(rs_in, "sum").tolist()
        # all_to_all with uneven splits: rank i sends i+1 rows to every rank.
        send = torch.full((n * (r + 1),), float(r))
        recv_sizes = [i + 1 for i in range(n)]
        out["all_to_all"] = comm.all_to_all(send, [r + 1] * n, recv_sizes).tolist()
        ring = comm.exchange(torch.tensor([float(r)]), (r + 1) % n, torch.zeros(1), (r - 1) % n)
        out["exchange"] = ring.tolist()
        out["objects"] = comm.all_gather_object({"rank": r})
        out["bcast_obj"] = comm.broadcast_object(f"from {r}", src=0)
        comm.barrier(timeout_s=10)
        return out
    finally:
        par.close()


def test_every_collective_on_three_ranks() -> None:
    results = run_ranks(_all_ops, 3)
    for r, out in enumerate(results):
        assert out["all_reduce_max"] == [2, 0]
        assert out["all_reduce_mean_int"] == [3]  # (0+3+6)//3
        assert out["broadcast"] == [20.0]
        assert out["all_gather"] == [[0, 0], [1, 1], [2, 2]]
        assert out["uneven"] == [[], [1.0], [2.0, 2.0]]
        base = [2 * r, 2 * r + 1]
        assert out["reduce_scatter"] == [[3 * base[0] + 3.0, 3 * base[1] + 3.0]]
        assert out["all_to_all"] == [float(i) for i in range(3) for _ in range(i + 1)]
        assert out["exchange"] == [float((r - 1) % 3)]
        assert out["objects"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert out["bcast_obj"] == "from 0"
    assert results[1]["reduce_on_dst"] == [6.0]


def _mismatch(use_env: bool) -> str:
    par = Parallel(strategy="ddp", timeout_s=20)
    try:
        size = 4 if par.rank != 1 else 8  # rank 1 disagrees on the shape
        try:
            if use_env:
                comm.all_reduce(torch.ones(size))  # MANYGPU_DEBUG=1 is set
            else:
                comm.all_reduce(torch.ones(size), debug=True)
        except comm.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"
    finally:
        par.close()


def test_debug_mode_names_the_rank_that_differs() -> None:
    for message in run_ranks(_mismatch, 3, False):
        assert "ranks 0, 2 call all_reduce(float32[4], arg=0)" in message
        assert "rank 1 calls all_reduce(float32[8], arg=0)" in message


def test_debug_mode_from_the_environment() -> None:
    results = run_ranks(_mismatch, 2, True, extra_env={"MANYGPU_DEBUG": "1"})
    assert all("collective mismatch" in m for m in results)


def _skip_or_extra(calls_on_rank1: int) -> str:
    """Rank 0 makes 3 all_reduces of one shape from one line; rank 1 makes ``calls_on_rank1``."""
    par = Parallel(strategy="ddp", timeout_s=20, debug=True)
    try:
        try:
            for _ in range(3 if par.rank == 0 else calls_on_rank1):
                comm.all_reduce(torch.ones(4), debug=True)
            par.close()
        except comm.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("calls, words", [(2, "after 2 calls"), (4, "as call #4")])
def test_debug_mode_names_a_skipped_or_extra_collective(calls: int, words: str) -> None:
    """Same op, same shape, same line: only the call count can tell, and it does."""
    for message in run_ranks(_skip_or_extra, 2, calls):
        assert "collective mismatch" in message and words in message, message
        assert "end of the job" in message


def _send_without_receiver() -> str:
    par = Parallel(strategy="ddp", timeout_s=20)
    if par.rank == 1:
        time.sleep(4)  # never sends; outlives rank 0's 2 s timeout
        return ""
    try:
        comm.recv(torch.zeros(3), src=1, timeout_s=2)
    except CollectiveTimeoutError as exc:
        # A timed-out group is unusable (as with NCCL): no collective after this.
        return str(exc)
    return "no error"


def test_point_to_point_timeout_names_operation() -> None:
    message = run_ranks(_send_without_receiver, 2)[0]
    assert message.startswith("rank 0: recv[src=1](float32[3]) did not complete within 2s")
