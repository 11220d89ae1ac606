"""manygpu.horovod on 2 real gloo ranks: dtypes gloo lacks, integer scaling, names, failures.

gloo has no int16, uint16, uint32 or uint64: these travel in a wider dtype
(:mod:`manygpu.horovod.wire`) and must arrive exact, through every operation.
Named calls meet by name, not by order, as Horovod's. One job makes every check
and returns the answers, then stalls on purpose
last (with a short timeout) to see that a script catching
``hvd.HorovodInternalError`` catches manygpu's failure of a collective.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from dist_harness import preload, run_ranks

preload("manygpu.horovod")

TIMEOUT_S = 4


def _plain(value: Any) -> Any:
    """Tensors as ``(dtype, values)``: torch cannot unpickle a uint16 tensor's storage."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype).removeprefix("torch."), value.tolist())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _carried(hvd: Any, r: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = torch.tensor([r - 32768, 32767 - r, r][: 2 + r], dtype=torch.int16)  # 2 or 3 rows
    out["allgather"] = hvd.allgather(mine)
    out["broadcast"] = hvd.broadcast(torch.full((3,), 1000 * (r + 1), dtype=torch.int16), 1)
    inplace = torch.full((2,), -5 * (r + 1), dtype=torch.int16)
    hvd.broadcast_(inplace, 1)
    out["broadcast_"] = inplace
    sent = torch.tensor([10 * r, 10 * r + 1, 10 * r + 2], dtype=torch.int16)
    out["alltoall"] = hvd.alltoall(sent, splits=[1, 2] if r == 0 else [2, 1])
    out["sum16"] = hvd.allreduce(torch.tensor([20000, -3], dtype=torch.int16), op=hvd.Sum)
    out["max_u16"] = hvd.allreduce(torch.tensor([65535 - r, r], dtype=torch.uint16), op=hvd.Max)
    out["sum_u32"] = hvd.allreduce(torch.tensor([2**31 + r], dtype=torch.uint32), op=hvd.Sum)
    out["u64"] = hvd.broadcast(torch.tensor([2**64 - 1 - r], dtype=torch.uint64), 1)
    out["grouped"] = hvd.grouped_allreduce(
        [torch.tensor([r + 1], dtype=torch.int16), torch.tensor([0.5])], op=hvd.Sum
    )
    out["reducescatter"] = hvd.reducescatter(
        torch.tensor([1, 2, 3], dtype=torch.int16) * (r + 1), op=hvd.Sum
    )
    return out


def _scaled(hvd: Any, r: int) -> dict[str, Any]:
    x = torch.tensor([-7, 7, 3 * r], dtype=torch.int32)
    return {
        "pre": hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5),
        "post": hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.25),
        "avg": hvd.allreduce(torch.tensor([-3 if r == 0 else 0, 5])),
        "rs": hvd.reducescatter(torch.tensor([5, 9], dtype=torch.int64), prescale_factor=0.5),
    }


def _names(hvd: Any) -> dict[str, Any]:
    x = torch.ones(3)
    first = hvd.allreduce_async(x, name="dup", op=hvd.Sum)
    try:
        hvd.allreduce_async(x, name="dup", op=hvd.Sum)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    return {"refused": refused, "first": hvd.synchronize(first)} | _by_name(hvd)


def _by_name(hvd: Any) -> dict[str, Any]:
    """Named calls meet by name (Horovod's model): rank 0 makes one before a barrier and
    rank 1 after it; and two named calls in opposite orders on the two ranks."""
    r = hvd.rank()
    x = torch.tensor([float(r)])
    early = grouped = None
    polled = None
    if r == 0:
        early = hvd.allgather_async(x, name="early")
        grouped = hvd.grouped_allgather_async([x, x], name="g")
        polled = hvd.poll(grouped)  # rank 1 has not made it: not done
    hvd.barrier()  # must not meet rank 0's allgather
    if r == 1:
        early = hvd.allgather_async(x, name="early")
        grouped = hvd.grouped_allgather_async([x, x], name="g")
    order = ["p", "q"] if r == 0 else ["q", "p"]
    handles = {n: hvd.allreduce_async(torch.tensor([r + 1.0]), name=n, op=hvd.Sum) for n in order}
    return {
        "early": hvd.synchronize(early),
        "g": hvd.synchronize(grouped),
        "polled": polled,
        "p": hvd.synchronize(handles["p"]),
        "q": hvd.synchronize(handles["q"]),
    }


def _job() -> dict[str, Any]:
    import manygpu.horovod as hvd
    from manygpu.errors import CollectiveTimeoutError

    hvd.init()
    try:
        r = hvd.rank()
        out = {k: _plain(v) for k, v in (_carried(hvd, r) | _scaled(hvd, r) | _names(hvd)).items()}
        start = time.monotonic()
        try:
            hvd.allreduce(torch.ones(2, dtype=torch.uint64), op=hvd.Sum)
            out["u64_reduce"] = "no error"
        except ValueError as exc:
            out["u64_reduce"] = str(exc)
        out["u64_reduce_s"] = time.monotonic() - start
        out["after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()  # still usable
        stuck = hvd.grouped_allgather_async([torch.ones(1)] * 2, name="stuck") if r == 0 else 0
        hvd.barrier()
        if r == 1:
            time.sleep(3 * TIMEOUT_S)  # never makes the named call rank 0 waits for
            return out
        try:
            hvd.synchronize(stuck)
            out["caught"] = "no error"
        except hvd.HorovodInternalError as exc:
            out["caught"] = [isinstance(exc, CollectiveTimeoutError), str(exc)]
        try:  # the failed call's names are free again
            hvd.grouped_allgather_async([torch.ones(1)] * 2, name="stuck")
        except ValueError as exc:
            out["reuse"] = str(exc)
        except hvd.HorovodInternalError:
            out["reuse"] = "free"  # its round times out: rank 1 is still away
        return out
    finally:
        hvd.shutdown()


def test_dtypes_scaling_names_and_failures_as_horovod() -> None:
    results = run_ranks(_job, 2, timeout=120, extra_env={"MANYGPU_TIMEOUT": str(TIMEOUT_S)})
    for r, out in enumerate(results):
        assert out["allgather"] == ("int16", [-32768, 32767, -32767, 32766, 1]), r
        assert out["broadcast"] == ("int16", [2000] * 3)
        assert out["broadcast_"] == ("int16", [-10, -10])
        assert out["alltoall"] == [
            ("int16", [0, 10, 11] if r == 0 else [1, 2, 12]),
            ("int32", [1, 2] if r == 0 else [2, 1]),
        ]
        # 40000 does not fit int16: it wraps as an int16 sum would.
        assert out["sum16"] == ("int16", [40000 - 65536, -6])
        assert out["max_u16"] == ("uint16", [65535, 1])
        assert out["sum_u32"] == ("uint32", [(2**32 + 1) % 2**32])
        assert out["u64"] == ("uint64", [2**64 - 2])
        assert out["grouped"] == [("int16", [3]), ("float32", [1.0])]
        assert out["reducescatter"] == ("int16", [3, 6] if r == 0 else [9])
        # Horovod: each rank's int32 * 0.5 truncated toward zero, then summed; then the sum
        # times 0.25 truncated; an average is sum * (1/2), truncated.
        assert out["pre"] == ("int32", [-6, 6, 1])
        assert out["post"] == ("int32", [-3, 3, 0])
        assert out["avg"] == ("int64", [-1, 5])
        assert out["rs"] == ("int64", [2] if r == 0 else [4])  # Average: (2 + 2) * (1/2)
        assert "another allreduce named 'dup' is still pending" in out["refused"]
        assert out["first"] == ("float32", [2.0, 2.0, 2.0])
        assert out["early"] == ("float32", [0.0, 1.0])
        assert out["g"] == [("float32", [0.0, 1.0])] * 2
        assert out["p"] == out["q"] == ("float32", [3.0])
        assert "allreduce of a uint64 tensor is not supported" in out["u64_reduce"]
        assert out["after"] == 2.0
    assert results[0]["polled"] is False
    assert results[0]["reuse"] == "free"
    caught = results[0]["caught"]
    assert caught[0] is True and "missing ranks: [1]" in caught[1], caught
