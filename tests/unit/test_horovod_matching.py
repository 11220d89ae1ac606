"""Named calls meet by name (:mod:`manygpu.horovod.matching`): the round's decisions.

Each round every rank sees the same table, so what starts and who goes on are
pure functions of it; these tests pass tables. The rounds themselves run on
real gloo ranks in tests/distributed/test_horovod_dtypes.py.
"""

from __future__ import annotations

from manygpu.horovod.matching import Point, common_names, goes_on

C, S, W = int(Point.COLLECTIVE), int(Point.SUBMIT), int(Point.WAIT)


def test_names_every_rank_made_start_in_rank_0s_order() -> None:
    rows = [(S, None, ["b", "a", "c"]), (C, None, ["a", "b"]), (W, "a", ["c", "a", "b"])]
    assert common_names(rows) == ["b", "a"]
    assert common_names([(C, None, ["a"]), (C, None, [])]) == []


def test_who_goes_on() -> None:
    # A rank that made a call goes on at once; one in synchronize once its call started.
    rows = [(S, None, ["a"]), (W, "a", ["a"]), (W, "b", ["b"])]
    assert goes_on(rows, {"a"}) == [True, True, False]
    # At an explicit collective: only once every rank is at one.
    assert goes_on([(C, None, ["a"]), (C, None, [])], set()) == [True, True]
    assert goes_on([(C, None, []), (S, None, ["a"])], set()) == [False, True]


def test_a_round_where_nobody_goes_on_is_a_deadlock() -> None:
    # Rank 0 waits for 'a', which rank 1 (blocked in a collective) never made.
    rows = [(W, "a", ["a"]), (C, None, [])]
    assert not any(goes_on(rows, set(common_names(rows))))
