"""hvd.join()'s decisions, as pure functions: who joined last, what joined ranks send.

Every rank makes these decisions from the same exchanged table, so they must
not depend on the rank deciding; the multi-rank behaviour is in
tests/distributed/test_horovod_join_ranks.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from manygpu.comm import debug as dbg
from manygpu.horovod.joining import BARRIER, agreed, zeros_spec
from manygpu.horovod.matching import Point, common_names, goes_on
from manygpu.horovod.stand_in import last_joined

JOINED = int(Point.JOINED)


def _row(op: str, extra: int = -1) -> tuple[int, ...]:
    """A check row as :func:`manygpu.comm.debug.gather_calls` builds it (op, then fields)."""
    return (dbg._OPS.index(op), -1, 0, *([-1] * 8), extra, 7, 0, -1, 0)


def test_last_joined_is_the_one_joined_for_fewest_rounds_ties_to_the_highest_rank() -> None:
    assert last_joined([[JOINED, 4], [JOINED, 0]]) == 1
    assert last_joined([[JOINED, 0], [JOINED, 4]]) == 0
    assert last_joined([[JOINED, 2], [JOINED, 0], [JOINED, 0]]) == 2


def test_zeros_spec_has_one_flat_per_device_and_dtype_in_the_wire_dtype() -> None:
    tensors = [torch.ones(4), torch.ones(3, dtype=torch.int16), torch.ones(2, 1)]
    assert zeros_spec(tensors, dist.ReduceOp.SUM) == {
        "zeros": [["cpu", "float32", 6, "SUM"], ["cpu", "int32", 3, "SUM"]]
    }
    assert zeros_spec([torch.ones(1)], dist.ReduceOp.MAX)["zeros"][0][3] == "MAX"


def test_joined_ranks_act_only_when_every_caller_asks_the_same() -> None:
    table = dbg.CallTable(rows=[_row("joined"), _row("all_reduce"), _row("all_reduce")], site="")
    spec = zeros_spec([torch.ones(2)], dist.ReduceOp.SUM)
    assert agreed(table, [["join()", None], ["a", spec], ["a", spec]]) == spec
    other = zeros_spec([torch.ones(3)], dist.ReduceOp.SUM)
    assert agreed(table, [["join()", None], ["a", spec], ["a", other]]) is None
    assert agreed(table, [["join()", None], ["g", {"refuse": "g"}], ["g", {"refuse": "g"}]]) is None
    barrier = dbg.CallTable(rows=[_row("barrier"), _row("joined")], site="")
    assert agreed(barrier, [["barrier()", BARRIER], ["join()", None]]) == BARRIER
    differ = dbg.CallTable(
        rows=[_row("joined"), _row("all_reduce", 1), _row("all_reduce", 2)], site=""
    )
    assert agreed(differ, [["join()", None], ["a", spec], ["a", spec]]) is None


def test_joined_rows_are_left_out_of_matching_named_calls() -> None:
    rows = [
        (JOINED, None, []),
        (int(Point.SUBMIT), None, ["a", "b"]),
        (int(Point.WAIT), "a", ["b", "a"]),
    ]
    ready = common_names(rows)
    assert ready == ["a", "b"]  # the first rank not joined gives the order
    assert goes_on(rows, set(ready)) == [False, True, True]
    at_collective = [(JOINED, None, []), (int(Point.COLLECTIVE), None, [])]
    assert goes_on(at_collective, set()) == [False, True]
    assert dbg.CallTable(rows=[_row("joined"), _row("barrier")], site="").joined() == [0]
