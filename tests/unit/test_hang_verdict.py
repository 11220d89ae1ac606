"""Hang verdicts from plain data: every rule of ``compose`` with the exact line it prints,
and the launcher's pure helpers (Flight Recorder records, faulthandler dumps, files)."""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import pytest

from manygpu.launch import hangwatch, verdict
from manygpu.launch.verdict import Collective, RankView, compose, own_frame

HERE = Path(__file__).name
AR = Collective(pg="0", seq=812, op="all_reduce", args="float32[10]")
WAIT = "all_reduce #812 that ranks 0-4, 6, 7 wait in"


def _job(
    *odd: RankView, missing: tuple[int, ...] = (), world: int = 8, coll: Collective = AR
) -> list[RankView]:
    """The ``odd`` views; every other rank but ``missing`` waits in ``coll``."""
    skip = {v.rank for v in odd} | set(missing)
    waiters = [
        RankView(rank=r, host=f"node{r // 4}", waiting=coll, where="train.py:88 in step()")
        for r in range(world)
        if r not in skip
    ]
    return [*waiters, *odd]


@pytest.mark.parametrize(
    ("seen", "tail"),
    [
        ({"where": "train.py:57 in save_checkpoint()"}, "is at train.py:57 in save_checkpoint()"),
        ({}, "is in its own code"),
        (
            {"where": "train.py:62", "detail": "in the DataLoader (worker 1 at data.py:40)"},
            "is at train.py:62, in the DataLoader (worker 1 at data.py:40)",
        ),
        (
            {"state": "stopped", "where": "train.py:57 in save_checkpoint()"},
            "is stopped (SIGSTOP or a debugger) at train.py:57 in save_checkpoint()",
        ),
        ({"state": "stopped"}, "is stopped (SIGSTOP or a debugger)"),
        (
            {"state": "silent", "where": "model.py:12 in forward()"},
            "does not answer: it is in native code holding the GIL at model.py:12 in forward()",
        ),
        ({"state": "silent"}, "does not answer: it is in native code holding the GIL"),
        ({"state": "exited", "detail": "its process is gone"}, "has exited (its process is gone)"),
        ({"state": "exited"}, "has exited"),
    ],
)
def test_one_rank_never_entered(seen: dict[str, Any], tail: str) -> None:
    line = f"rank 5 (host gpu7) never entered {WAIT}; rank 5 {tail}"
    views = _job(RankView(rank=5, host="gpu7", **seen))
    assert compose(views, 8) == compose(views[::-1], 8) == (line, 5)


def test_a_rank_in_another_collective_number() -> None:
    behind = Collective(pg="0", seq=811, op="all_reduce", args="float32[10]")
    views = _job(RankView(rank=5, host="gpu7", waiting=behind, where="t.py:50"))
    assert compose(views, 8) == (
        "rank 5 (host gpu7) waits in all_reduce #811 while ranks 0-4, 6, 7 wait in "
        "all_reduce #812, called at t.py:50",
        5,
    )
    views = _job(RankView(rank=5, host="gpu7", waiting=behind))
    assert compose(views, 8)[0].endswith("wait in all_reduce #812")


def test_several_culprits_blame_the_lowest_rank_out_of_any_collective() -> None:
    behind = Collective(pg="0", seq=811, op="all_reduce", args="float32[10]")
    views = _job(
        RankView(rank=2, host="node0", waiting=behind),
        RankView(rank=4, host="node1", state="stopped"),
        RankView(rank=3, host="node0", where="train.py:57 in save_checkpoint()"),
        missing=(5, 7),
    )
    assert compose(views, 8) == (
        "rank 3 (host node0) never entered all_reduce #812 that ranks 0, 1, 6 wait in; "
        "rank 3 is at train.py:57 in save_checkpoint() (also not in it: ranks 2, 4, 5, 7)",
        3,
    )
    views = _job(RankView(rank=6, host="node1", state="exited"), missing=(7,))
    assert compose(views, 8) == (
        "rank 6 (host node1) never entered all_reduce #812 that ranks 0-5 wait in; "
        "rank 6 has exited (also not in it: rank 7)",
        6,
    )


def test_ranks_that_never_answered_are_blamed_when_everyone_else_waits() -> None:
    assert compose(_job(missing=(5,)), 8) == (
        "rank 5 never answered; ranks 0-4, 6, 7 wait in all_reduce #812",
        5,
    )
    assert compose(_job(missing=(2, 3, 6)), 8) == (
        "ranks 2, 3, 6 never answered; ranks 0, 1, 4, 5, 7 wait in all_reduce #812",
        2,
    )
    group = Collective(pg="3", seq=4, op="all_gather", args="bfloat16[4,8]")
    assert compose([RankView(rank=0, host="a", waiting=group)], 2) == (
        "rank 1 never answered; rank 0 waits in all_gather #4 (group 3)",
        1,
    )


def test_same_number_different_op_or_args() -> None:
    skipped = Collective(pg="0", seq=10, op="barrier", args="")
    ddp = Collective(pg="0", seq=10, op="all_reduce", args="float32[10]")
    odd = RankView(rank=3, host="gpu3", waiting=skipped, where="train.py:59 in step()")
    assert compose(_job(odd, world=4, coll=ddp), 4) == (
        "all ranks wait in collective #10; rank 3 (host gpu3) started it as barrier(), "
        "the others as all_reduce(float32[10]); rank 3 is at train.py:59 in step()",
        3,
    )
    short = Collective(pg="0", seq=10, op="all_reduce", args="float32[12]")
    views = _job(
        RankView(rank=1, host="node0", waiting=short),
        RankView(rank=2, host="node1", waiting=short),
        world=4,
        coll=ddp,
    )
    assert compose(views, 4) == (
        "all ranks wait in collective #10; ranks 1, 2 (hosts node0,node1) started it as "
        "all_reduce(float32[12]), the others as all_reduce(float32[10])",
        1,
    )


def test_a_collective_only_rank_0_calls_under_strict_debug_names_the_users_line() -> None:
    """``if par.rank == 0: par.reduce(x)`` with ``MANYGPU_DEBUG=strict``: rank 0 waits in
    the debug check's all-gather, rank 1 in DDP's next broadcast. The check's all-gather
    is no cause, and at two ranks a tie must not blame rank 1: rank 0's line is named."""
    check = Collective(pg="0", seq=6, op="all_gather", args="int64[1,16]")
    ddp = Collective(pg="0", seq=6, op="broadcast", args="int32[3]")
    views = [
        RankView(rank=0, host="vm", waiting=check, where="train.py:15",
                 extra={verdict.DEBUG_CHECK: "1"}),
        RankView(rank=1, host="vm", waiting=ddp, where="train.py:10"),
    ]  # fmt: skip
    assert compose(views, 2) == (
        "rank 0 (host vm) calls a collective at train.py:15 that rank 1 never reaches "
        "(collective #6: rank 1 is in broadcast(int32[3]) at train.py:10); a collective "
        "only some ranks call (under `if rank == 0:`?) waits forever: call it on every rank",
        0,
    )
    debug_py = str(Path(verdict.__file__).parents[1] / "comm" / "debug.py")
    stack = [["/x/train.py", 15, "<module>"], [debug_py, 240, "gather_calls"]]
    assert verdict.in_debug_check(stack) and not verdict.in_debug_check(stack[:1])
    assert verdict.own_frame(stack) == "train.py:15"


def test_a_hang_verdicts_own_sigterm_is_not_reported_as_a_signal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from manygpu.launch.agent import _say_stopped

    _say_stopped(signal.SIGTERM, 2, judged=True)
    _say_stopped(signal.SIGTERM, 2)
    assert capsys.readouterr().err.splitlines() == [
        "manygpu: stopped after the hang verdict; stopped 2 workers",
        "manygpu: stopped by SIGTERM; stopped 2 workers",
    ]


def test_odd_ranks_that_disagree_among_themselves_are_each_named() -> None:
    ddp = Collective(pg="0", seq=10, op="all_reduce", args="float32[10]")
    views = _job(
        RankView(rank=5, host="gpu5", waiting=Collective(pg="0", seq=10, op="broadcast")),
        RankView(rank=3, host="gpu3", waiting=Collective(pg="0", seq=10, op="barrier")),
        coll=ddp,
    )
    assert compose(views, 8) == (
        "all ranks wait in collective #10; rank 3 (host gpu3) started it as barrier(), "
        "rank 5 (host gpu5) as broadcast(), the others as all_reduce(float32[10])",
        3,
    )


def test_a_tie_blames_the_same_rank_whatever_the_order_of_views() -> None:
    a = RankView(rank=0, host="a", waiting=Collective(pg="0", seq=1, op="all_reduce"))
    b = RankView(rank=1, host="b", waiting=Collective(pg="0", seq=1, op="barrier"))
    assert compose([a, b], 2) == compose([b, a], 2)
    assert compose([a, b], 2)[1] == 1


def test_all_identical_is_the_network() -> None:
    views = _job(world=4, coll=Collective(pg="2", seq=7, op="reduce_scatter"))
    assert compose(views, 4) == (
        "all ranks wait in reduce_scatter #7 (group 2) with the same arguments: no rank is "
        "missing, so a connection between them is stuck (network, or a peer's backend thread)",
        0,
    )


def test_no_rank_waiting() -> None:
    views = [RankView(rank=r, host="a", where="train.py:3") for r in (2, 1)]
    assert compose(views, 3) == ("no rank waits in a collective; nothing to blame", 1)


# -- frames -------------------------------------------------------------------------------


def test_own_frame_skips_libraries_but_not_a_checkout_named_manygpu() -> None:
    torch_c10d = "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    stack: list[list[object]] = [
        ["/home/u/manygpu/examples/train.py", 80, "<module>"],
        ["/home/u/manygpu/examples/train.py", 57, "save_checkpoint"],
        [verdict.__file__, 10, "compose"],
        ["<frozen importlib._bootstrap>", 1, "_load"],
        [torch_c10d, 2500, "all_reduce"],
    ]
    assert own_frame(stack) == "train.py:57 in save_checkpoint()"
    assert own_frame(stack[:1]) == "train.py:80"
    assert own_frame(stack[2:]) == "distributed_c10d.py:2500 in all_reduce()"
    assert own_frame(stack[2:], own_only=True) == own_frame([]) == ""
    loader = "/v/lib/python3.11/site-packages/torch/utils/data/dataloader.py"
    assert verdict.in_dataloader([*stack, [loader, 1, "__next__"]])
    assert not verdict.in_dataloader(stack)


def _park(event: threading.Event) -> None:
    event.wait(30)


@pytest.fixture
def helper_thread() -> Iterator[None]:
    event = threading.Event()
    thread = threading.Thread(target=_park, args=(event,), daemon=True)
    thread.start()
    yield
    event.set()
    thread.join()


def _dump(fh: IO[str], header: str = "") -> int:
    """A real faulthandler dump of every thread into ``fh``; the line it was taken at."""
    fh.write(header)
    fh.flush()
    line = sys._getframe().f_lineno + 1
    faulthandler.dump_traceback(file=fh, all_threads=True)
    fh.write("\nExtension modules: torch._C, numpy.core._multiarray_umath (total: 2)\n")
    return line


@pytest.mark.usefixtures("helper_thread")
def test_parse_faulthandler_lists_the_main_thread_last(tmp_path: Path) -> None:
    with open(tmp_path / "dump.txt", "w") as fh:
        line = _dump(fh)
    stacks = verdict.parse_faulthandler((tmp_path / "dump.txt").read_text())
    assert len(stacks) >= 2
    assert own_frame(stacks[-1]) == f"{HERE}:{line} in _dump()"
    assert Path(str(stacks[-1][-1][0])).name == HERE and stacks[-1][-1][1:] == [line, "_dump"]
    parked = [s for s in stacks[:-1] if own_frame(s, own_only=True).endswith(" in _park()")]
    assert len(parked) == 1 and Path(str(parked[0][-1][0])).name == "threading.py"
    assert verdict.parse_faulthandler("") == []


@pytest.mark.usefixtures("helper_thread")
def test_crash_site_reads_the_last_fatal_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = tmp_path / "native-rank3.txt"
    monkeypatch.setenv("MANYGPU_EVIDENCE_DIR", str(tmp_path))
    assert hangwatch.crash_site(3, signal.SIGABRT) == ""  # no file yet
    with open(native, "w") as fh:
        _dump(fh)  # an earlier SIGUSR2 answer, not a crash
    assert hangwatch.crash_site(3, signal.SIGABRT) == ""
    with open(native, "a") as fh:
        line = _dump(fh, "Fatal Python error: Aborted\n\n")
    assert hangwatch.crash_site(3, signal.SIGABRT) == f"{HERE}:{line} in _dump()"
    assert hangwatch.crash_site(3, signal.SIGSEGV) == f"{HERE}:{line} in _dump()"
    assert hangwatch.crash_site(3, signal.SIGTERM) == ""  # not a signal faulthandler dumps on
    assert hangwatch.crash_site(2, signal.SIGABRT) == ""
    monkeypatch.delenv("MANYGPU_EVIDENCE_DIR")
    assert hangwatch.crash_site(3, signal.SIGABRT) == ""


# -- the launcher's pure helpers -----------------------------------------------------------


def test_alarm_leaves_fifteen_seconds_or_half_a_short_timeout() -> None:
    assert hangwatch.alarm_after(600) == 585
    assert hangwatch.alarm_after(30) == 15
    assert hangwatch.alarm_after(12) == 6


def _record(seq: int, op: str, dtypes: list[str], sizes: list[list[int]]) -> dict[str, Any]:
    """One Flight Recorder entry, as torch's dump spells it."""
    return {
        "process_group": ["0", "default_pg"],
        "collective_seq_id": seq,
        "profiling_name": f"nccl:{op}",
        "input_dtypes": dtypes,
        "input_sizes": sizes,
    }


def test_args_and_collective_from_flight_recorder_records() -> None:
    two = _record(812, "all_reduce", ["Float", "BFloat16"], [[10], [4, 8]])
    assert hangwatch._args(two) == "float32[10], bfloat16[4,8]"
    assert hangwatch._args(_record(1, "barrier", ["Float8_e4m3fn"], [[]])) == "Float8_e4m3fn[]"
    assert hangwatch._args({}) == ""
    doc = {
        "waiting": {"pg": 0, "seq": 812},
        "flight_recorder": {"entries": [_record(811, "broadcast", ["Long"], [[3]]), two]},
    }
    assert hangwatch._collective(doc) == Collective(
        pg="0", seq=812, op="all_reduce", args="float32[10], bfloat16[4,8]"
    )
    unrecorded = {**doc, "waiting": {"pg": "1", "seq": 812}}
    assert hangwatch._collective(unrecorded) == Collective(pg="1", seq=812)
    assert hangwatch._collective({"waiting": None}) is None


def test_view_round_trips_through_json() -> None:
    view = RankView(rank=3, host="gpu3", waiting=AR, where="t.py:1", extra={"k": "v"})
    assert hangwatch._view(json.loads(json.dumps(asdict(view)))) == view
    plain = RankView(rank=1, host="a", state="exited")
    assert hangwatch._view(json.loads(json.dumps(asdict(plain)))) == plain


def test_main_stack_prefers_main_thread() -> None:
    worker = {"name": "pin_memory", "stack": [["w.py", 1, "loop"]]}
    main = {"name": "MainThread", "stack": [["t.py", 2, "step"]]}
    assert hangwatch._main_stack([worker, main]) == [["t.py", 2, "step"]]
    assert hangwatch._main_stack([worker]) == [["w.py", 1, "loop"]]
    assert hangwatch._main_stack([]) == []


def test_read_all_takes_numbered_files_and_skips_broken_ones(tmp_path: Path) -> None:
    for name, doc in [("progress-rank0", 0), ("progress-rank12", 12), ("rank1", 1)]:
        (tmp_path / f"{name}.json").write_text(json.dumps({"rank": doc}))
    (tmp_path / "progress-rank3.json").write_text('{"rank": ')  # half written
    (tmp_path / "progress-rank-x.json").write_text("{}")
    (tmp_path / "progress-rank4.json.tmp").write_text("{}")
    got = sorted(d["rank"] for d in hangwatch._read_all(tmp_path, "progress-rank"))
    assert got == [0, 12]
    assert [d["rank"] for d in hangwatch._read_all(tmp_path, "rank")] == [1]
    assert hangwatch._read_all(tmp_path / "missing", "rank") == []


def test_an_earlier_attempts_files_raise_no_alarm_and_count_no_rank(tmp_path: Path) -> None:
    """After an elastic restart to a smaller world, rank 3's files of attempt 0
    remain; its old wait must not raise an alarm, nor rank 3 count in the world."""

    def put(name: str, doc: dict[str, Any]) -> None:
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))

    put("hello-rank3", {"rank": 3, "pid": 1, "world": 4, "attempt": 0})
    put("progress-rank3", {"rank": 3, "attempt": 0, "waiting": {"pg": "0", "seq": 9, "since": 0}})
    for rank in range(3):
        put(f"hello-rank{rank}", {"rank": rank, "pid": 1, "world": 3, "attempt": 1})
        put(f"progress-rank{rank}", {"rank": rank, "attempt": 1, "waiting": None})
    watch = hangwatch.HangWatch(out=tmp_path, host="h", default_timeout_s=20)
    assert watch._alarm() is None
    assert watch._world() == 3
    # The same stale wait in the current attempt does raise it.
    put("progress-rank2", {"rank": 2, "attempt": 1, "waiting": {"pg": "0", "seq": 9, "since": 0}})
    assert watch._alarm() is not None
