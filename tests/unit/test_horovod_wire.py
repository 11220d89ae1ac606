"""manygpu.horovod's dtype carrying, Horovod's integer scaling, pending names and exceptions.

In one process: the pure parts (which dtype a tensor travels as, how a factor
scales an integer) and what a world of one already shows (a second pending
call with the same name is refused). The dtypes on real gloo ranks are in
tests/distributed/test_horovod_dtypes.py.
"""

from __future__ import annotations

import pytest
import torch

import manygpu.horovod as hvd
from manygpu.errors import CollectiveTimeoutError, UsageError
from manygpu.horovod.exceptions import HorovodCollectiveError, internal
from manygpu.horovod.reduce_ops import ReduceOp, finish_, scale_
from manygpu.horovod.wire import from_wire, to_wire, wire_dtype

CPU = torch.device("cpu")


# -- the wire -------------------------------------------------------------------------
def test_dtypes_gloo_lacks_travel_in_a_wider_one() -> None:
    assert wire_dtype(torch.int16, CPU, "allgather", reduce=False) == torch.int32
    assert wire_dtype(torch.uint16, CPU, "allreduce", reduce=True) == torch.int32
    assert wire_dtype(torch.uint32, CPU, "allreduce", reduce=True) == torch.int64
    assert wire_dtype(torch.uint64, CPU, "broadcast", reduce=False) == torch.int64
    for same in (torch.float32, torch.bfloat16, torch.int8, torch.uint8, torch.bool):
        assert wire_dtype(same, CPU, "allreduce", reduce=True) == same


def test_carried_values_come_back_exactly() -> None:
    for dtype, values in (
        (torch.int16, [-32768, -1, 0, 32767]),
        (torch.uint16, [0, 1, 65535]),
        (torch.uint32, [0, 2**32 - 1]),
        (torch.uint64, [0, 2**64 - 1]),
    ):
        x = torch.tensor(values, dtype=dtype)
        wired = to_wire(x, "broadcast")
        assert wired.dtype != dtype
        back = from_wire(wired, dtype)
        assert back.dtype == dtype and torch.equal(back, x), dtype
    plain = torch.ones(3)
    assert to_wire(plain, "allreduce", reduce=True) is plain  # no copy when none is needed


def test_what_cannot_travel_is_refused_naming_the_dtype() -> None:
    with pytest.raises(UsageError, match=r"allreduce of a uint64 tensor is not supported.*int64"):
        wire_dtype(torch.uint64, CPU, "allreduce", reduce=True)
    with pytest.raises(
        UsageError, match=r"allgather of a float8_e4m3fn tensor is not supported on CPU \(gloo\)"
    ):
        to_wire(torch.zeros(2, dtype=torch.float8_e4m3fn), "allgather")


# -- Horovod's scaling ------------------------------------------------------------------
def test_integers_scale_in_float64_and_truncate_toward_zero() -> None:
    x = torch.tensor([-7, -1, 7, 100], dtype=torch.int32)
    scale_(x, 0.5, "prescale_factor")
    assert x.dtype == torch.int32 and x.tolist() == [-3, 0, 3, 50]
    big = torch.tensor([2**40 + 1], dtype=torch.int64)
    scale_(big, 3.0, "prescale_factor")
    assert big.tolist() == [3 * (2**40 + 1)]
    with pytest.raises(UsageError, match=r"needs a numeric tensor, not torch\.bool"):
        scale_(torch.ones(2, dtype=torch.bool), 2.0, "prescale_factor")


def test_an_integer_average_is_one_factor_truncated_toward_zero() -> None:
    # Horovod folds the average into the postscale factor: sum * (post / world).
    assert finish_(torch.tensor([-3, 3, 5]), ReduceOp.Average, 1.0, 2).tolist() == [-1, 1, 2]
    assert finish_(torch.tensor([10]), ReduceOp.Average, 0.5, 2).tolist() == [2]
    assert finish_(torch.tensor([10]), ReduceOp.Sum, 0.3, 2).tolist() == [3]
    assert finish_(torch.tensor([1.0, 3.0]), ReduceOp.Average, 3.0, 2).tolist() == [1.5, 4.5]


def test_integer_prescale_and_postscale_are_accepted(one: None) -> None:
    x = torch.tensor([-5, 5, 9], dtype=torch.int32)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert out.dtype == torch.int32 and out.tolist() == [-6, 6, 12]


# -- names of pending calls -------------------------------------------------------------
def test_a_second_pending_call_with_the_same_name_is_refused(one: None) -> None:
    x = torch.ones(3)
    first = hvd.allreduce_async(x, name="g")
    with pytest.raises(ValueError, match="another allreduce named 'g' is still pending"):
        hvd.allreduce_async(x, name="g")
    other = hvd.allgather_async(x, name="g")  # another operation: another name, as Horovod
    hvd.synchronize(other)
    assert hvd.synchronize(first).tolist() == [1.0, 1.0, 1.0]
    hvd.synchronize(hvd.allreduce_async(x, name="g"))  # free again once synchronized
    for start in (
        lambda: hvd.broadcast_async(x, 0, name="b"),
        lambda: hvd.alltoall_async(x, name="b"),
        lambda: hvd.reducescatter_async(x, name="b"),
        lambda: hvd.grouped_allreduce_async([x], name="b"),
    ):
        handle = start()
        with pytest.raises(ValueError, match="named 'b' is still pending"):
            start()
        hvd.synchronize(handle)
    a, b = hvd.allreduce_async(x), hvd.allreduce_async(x)  # unnamed calls never clash
    hvd.synchronize(a), hvd.synchronize(b)


# -- exceptions -------------------------------------------------------------------------
def test_horovods_exceptions_are_runtime_errors_and_catch_manygpus_failures() -> None:
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    interrupt = hvd.HostsUpdatedInterrupt(skip_sync=True)
    assert isinstance(interrupt, RuntimeError) and interrupt.skip_sync is True
    cause = CollectiveTimeoutError(1, "allreduce('x', float32[4])", 4.0, "missing ranks: [2]")
    err = internal(cause)
    assert isinstance(err, hvd.HorovodInternalError) and isinstance(err, CollectiveTimeoutError)
    assert isinstance(err, HorovodCollectiveError) and internal(err) is err
    assert (err.rank, err.operation, err.timeout_s) == (1, cause.operation, 4.0)
    assert str(err) == str(cause)
