"""A rank whose answer is older than the others' is asked again before it is blamed.

The race the emulated-cluster test met under load (``ddp_skip``): rank 0's first
answer still showed all_reduce #9 open although ranks 1-3 had finished it and
waited in #10, so the verdict named rank 0 instead of rank 3's ``barrier()``.
Here the workers are played by a thread that answers the launcher's requests
from a script of answers (plain files, as the real watchers write them); the
stores are torch's own in-memory ``HashStore``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from manygpu.launch import hangwatch
from manygpu.launch.verdict import Collective, RankView, behind

ALL_REDUCE = ("all_reduce", ["Float"], [[10]])
BARRIER = ("barrier", [], [])
MISMATCH = (
    "all ranks wait in collective #10; rank 3 (host {host}) started it as barrier(), "
    "the others as all_reduce(float32[10]); rank 3 is at train.py:59"
)


def test_behind_names_ranks_whose_open_collective_others_have_finished() -> None:
    def view(rank: int, seq: int | None, pg: str = "0") -> RankView:
        waiting = None if seq is None else Collective(pg=pg, seq=seq)
        return RankView(rank=rank, host="a", waiting=waiting)

    assert behind([view(0, 9), view(1, 10), view(2, 10), view(3, 10)]) == [0]
    assert behind([view(2, 8), view(0, 9), view(1, 10)]) == [0, 2]
    assert behind([view(0, 10), view(1, 10)]) == []
    # Another group's numbers say nothing of this one's, nor a rank in none.
    assert behind([view(0, 3, pg="1"), view(1, 10), view(2, None)]) == []
    assert behind([]) == []


class Workers:
    """This host's ranks as the launcher sees them: hello files, then, for each request,
    one answer per rank; ``script[rank]`` lists the collective it says it waits in, per
    request (the last one repeated)."""

    def __init__(self, out: Path, script: dict[int, list[tuple[int, tuple[str, Any, Any]]]]):
        self.out, self.script = out, script
        self.asked: list[str] = []
        self._stop = threading.Event()
        for rank in script:
            doc = {"rank": rank, "pid": os.getpid(), "world": 4, "attempt": 0}
            (out / f"hello-rank{rank}.json").write_text(json.dumps(doc))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            request = self.out / "request"
            ask = request.read_text() if request.exists() else ""
            if ask and ask not in self.asked:
                self.asked.append(ask)
                for rank in self.script:
                    self._answer(rank, ask)

    def _answer(self, rank: int, ask: str) -> None:
        answers = self.script[rank]
        seq, (op, dtypes, sizes) = answers[min(len(self.asked), len(answers)) - 1]
        record = {
            "process_group": ["0", "default_pg"],
            "collective_seq_id": seq,
            "profiling_name": f"gloo:{op}",
            "input_dtypes": dtypes,
            "input_sizes": sizes,
        }
        line = 59 if op == "barrier" else 40
        doc = {
            "request": ask,
            "rank": rank,
            "threads": [{"name": "MainThread", "stack": [["/job/train.py", line, "<module>"]]}],
            "flight_recorder": {"entries": [record]},
            "waiting": {"pg": "0", "seq": seq, "since": 0},
        }
        path = self.out / f"rank{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(doc))
        os.replace(path.with_suffix(".tmp"), path)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hangwatch, "RECHECK_WAIT_S", 0.05)


@pytest.fixture
def workers() -> Iterator[list[Workers]]:
    started: list[Workers] = []
    yield started
    for w in started:
        w.stop()


def _watch(out: Path, host: str, said: list[str]) -> hangwatch.HangWatch:
    return hangwatch.HangWatch(
        out=out, host=host, default_timeout_s=20, end_job=lambda: None, say=said.append
    )


def _stale_rank0() -> dict[int, list[tuple[int, tuple[str, Any, Any]]]]:
    """Rank 0 says #9 at the first request and #10 after; ranks 1-2 wait in #10."""
    return {0: [(9, ALL_REDUCE), (10, ALL_REDUCE)], 1: [(10, ALL_REDUCE)], 2: [(10, ALL_REDUCE)]}


def test_a_rank_behind_the_others_is_asked_again_before_it_is_blamed(
    tmp_path: Path, workers: list[Workers]
) -> None:
    workers.append(Workers(tmp_path, {**_stale_rank0(), 3: [(10, BARRIER)]}))
    said: list[str] = []
    watch = _watch(tmp_path, "h", said)
    watch._judge("first")
    assert watch.verdict == (MISMATCH.format(host="h"), 3), said
    assert len(workers[0].asked) == 2  # the first request, then once again
    assert said[0] == f"manygpu: hang: {MISMATCH.format(host='h')}"


def test_no_question_again_when_the_waits_are_about_to_time_out(
    tmp_path: Path, workers: list[Workers]
) -> None:
    """The collective's own timeout ends the waits (and the evidence) soon: no time to ask
    again, so the verdict is given on the answers there are."""
    workers.append(Workers(tmp_path, {**_stale_rank0(), 3: [(10, BARRIER)]}))
    soon = {"rank": 1, "attempt": 0, "timeout_s": 20, "waiting": {"since": time.time() - 18}}
    (tmp_path / "progress-rank1.json").write_text(json.dumps(soon))
    watch = _watch(tmp_path, "h", [])
    watch._judge("first")
    assert watch.verdict is not None
    assert watch.verdict[1] == 0
    assert watch.verdict[0].startswith("rank 0 (host h) waits in all_reduce #9 while ranks 1-3")
    assert len(workers[0].asked) == 1


def test_a_rank_on_another_host_is_asked_again_through_the_store(
    tmp_path: Path, workers: list[Workers]
) -> None:
    """Host b's rank 2 is the stale one: the gathering host a asks host b again through
    the job's store, and host b answers for its ranks while it waits for the verdict."""
    store = dist.HashStore()
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    out_a.mkdir(), out_b.mkdir()
    workers.append(Workers(out_a, {0: [(10, ALL_REDUCE)], 1: [(10, ALL_REDUCE)]}))
    workers.append(Workers(out_b, {2: [(9, ALL_REDUCE), (10, ALL_REDUCE)], 3: [(10, BARRIER)]}))
    said: list[str] = []
    gatherer, other = _watch(out_a, "a", said), _watch(out_b, "b", [])
    gatherer.store, other.store = store, store
    other.gathers = False
    remote = threading.Thread(target=other._judge, args=("first",), daemon=True)
    remote.start()
    gatherer._judge("first")
    remote.join(30)
    expected = (MISMATCH.format(host="b"), 3)
    assert gatherer.verdict == other.verdict == expected, said
    assert len(workers[1].asked) == 2
    assert len(workers[0].asked) == 1  # the gatherer's own ranks were not stale
