"""The one way a message names several ranks (:mod:`manygpu.runtime.ranks`)."""

from __future__ import annotations

from manygpu.runtime.ranks import ranks_text


def test_one_rank_and_the_word_agrees() -> None:
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([3, 3]) == "rank 3"
    assert ranks_text([]) == "no rank"


def test_runs_of_three_or_more_read_as_ranges() -> None:
    assert ranks_text([1, 0]) == "ranks 0, 1"
    assert ranks_text([0, 1, 2, 3, 5, 7, 8]) == "ranks 0-3, 5, 7, 8"
    assert ranks_text([7, 6, 4, 2, 1, 0]) == "ranks 0-2, 4, 6, 7"
    assert ranks_text([1, 3, 5]) == "ranks 1, 3, 5"
    assert ranks_text(iter([9, 10, 11, 12])) == "ranks 9-12"
