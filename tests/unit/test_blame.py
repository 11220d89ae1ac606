"""The launcher's root cause: first in time, consequences last (pure functions)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from manygpu.errors import CollectiveTimeoutError, PeerLostError
from manygpu.launch import blame


def test_a_recorded_raise_beats_a_peer_that_timed_out_first_in_whole_seconds() -> None:
    rank0 = blame.outcome(
        0, 1, 100, {"time_ns": 5, "kind": "exception", "code": 1, "consequence": True}
    )
    rank1 = blame.outcome(
        1, -15, 99, {"time_ns": 9, "kind": "exception", "code": 1, "consequence": False}
    )
    assert blame.root_cause([rank0, rank1]).rank == 1


def test_sigkill_without_a_note_is_a_root_cause_sigterm_is_a_consequence() -> None:
    killed = blame.outcome(2, -9, 100, None)
    stopped = blame.outcome(0, -15, 99, None)
    assert killed.exit_code == 137 and not killed.consequence
    assert stopped.consequence and stopped.exit_code == 143
    assert blame.root_cause([stopped, killed]).rank == 2


def test_exit_code_comes_from_the_note() -> None:
    o = blame.outcome(1, -6, 100, {"time_ns": 1, "kind": "exit", "code": 3, "consequence": False})
    assert o.exit_code == 3 and o.how == "failed with exit code 3"


RETURNED = {"time_ns": 1, "kind": blame.RETURNED, "code": 0, "consequence": False}


def test_a_rank_that_returned_and_then_died_is_said_to_have_returned() -> None:
    """The note that the script returned changes the words only: the code, the time
    (torch's, when it died) and whether it is a consequence are the signal's."""
    aborted = blame.outcome(1, -6, 100, RETURNED)
    assert aborted.exit_code == 134 and aborted.time_ns == 100 * 10**9
    assert not aborted.consequence
    assert aborted.how == (
        "was killed by SIGABRT after its script had returned: in the interpreter's "
        "shutdown, a daemon thread still in native code or a native destructor"
    )
    stopped = blame.outcome(0, -15, 100, RETURNED)  # the agent stopped it: no native words
    assert stopped.consequence
    assert stopped.how == "was killed by SIGTERM after its script had returned"
    exited = blame.outcome(2, 3, 100, RETURNED)  # os._exit(3) in an atexit handler
    assert exited.exit_code == 3
    assert exited.how == "failed with exit code 3 after its script had returned"


def test_a_failure_without_an_error_is_pointed_back_at_its_note(tmp_path: Path) -> None:
    """torch replaces the error file's path with "<N/A>" when the worker wrote no error
    (an exit code, a signal); the note beside the path it was given is read again."""
    given = str(tmp_path / "attempt_0" / "1" / "error.json")
    failure = ProcessFailure(local_rank=1, pid=7, exitcode=-6, error_file=given)
    assert failure.error_file != given  # torch's "<N/A>": the note is out of reach
    (tmp_path / "attempt_0" / "1").mkdir(parents=True)
    (tmp_path / "attempt_0" / "1" / f"error.json{blame.NOTE_SUFFIX}").write_text(
        json.dumps(RETURNED)
    )
    blame.reach_notes({3: failure}, {0: "elsewhere", 1: given})
    assert failure.error_file == given and blame.read(failure.error_file) == RETURNED


def test_peer_failures_are_recognised() -> None:
    assert blame.is_peer_failure(CollectiveTimeoutError(0, "all_reduce", 5.0))
    assert not blame.is_peer_failure(ValueError("connection closed by peer"))  # user code
    assert not blame.is_peer_failure(RuntimeError("connection closed by peer"))  # user code


GLOO_LOST = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [10.213.0.2]:41639. This is typically caused by a remote worker crashing."
)


def test_gloos_lost_connection_as_a_plain_runtime_error_is_a_peer_failure() -> None:
    """gloo raises RuntimeError (FSDP's all-gather, a raw collective): still a peer's failure."""
    assert blame.is_peer_failure(RuntimeError(GLOO_LOST))


def test_the_lost_peers_addresses_are_read_from_the_errors() -> None:
    other = "Connection reset by peer [fd00::3]:29500"
    read = "[/x/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.7]:21173: Connection reset"
    texts = [GLOO_LOST, GLOO_LOST.replace("41639", "5290"), other, read, "no address here"]
    assert blame.peer_addresses(texts) == ["10.213.0.2", "fd00::3", "10.0.0.7"]


def test_a_lost_peer_is_not_called_a_timeout() -> None:
    lost = CollectiveTimeoutError(0, "all_reduce", 180.0, GLOO_LOST)
    assert isinstance(lost, PeerLostError) and isinstance(lost, CollectiveTimeoutError)
    assert str(lost) == (
        "rank 0: all_reduce failed: a peer rank died or lost its connection (Connection "
        "closed by peer [10.213.0.2]:41639); its own failure is the cause"
    )  # the backend's words without its source path and advice; the address kept
    assert blame.peer_addresses([str(lost)]) == ["10.213.0.2"] and blame.is_peer_failure(lost)
    again = pickle.loads(pickle.dumps(lost))  # an error crosses processes whole
    assert type(again) is PeerLostError and str(again) == str(lost) and again.rank == 0
    timeout = CollectiveTimeoutError(0, "all_reduce", 5.0, "Timed out waiting")
    assert type(timeout) is CollectiveTimeoutError and "did not complete within 5s" in str(timeout)


def test_a_consequence_s_line_keeps_the_backend_s_words_not_its_source_and_advice() -> None:
    raw = "RuntimeError: " + GLOO_LOST + " Check the logs of the remote worker. GLHF! x"
    assert blame.tidy(raw) == "RuntimeError: Connection closed by peer [10.213.0.2]:41639"
    assert blame.tidy("ValueError: a user's own. words") == "ValueError: a user's own. words"


def test_a_restart_is_one_line_naming_the_rank_the_cause_and_the_attempt() -> None:
    line = blame.restart_line("rank 1 was killed by SIGKILL (pid 7)", 1, 2)
    assert line == "rank 1 was killed by SIGKILL (pid 7); restarting every worker (restart 1 of 2)"


def test_a_lost_peer_prints_no_traceback_unless_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under the launcher (an error file) a rank that lost its peer prints nothing: the
    launcher says it after the peer's own death; MANYGPU_TRACEBACK=1 prints it all."""
    from manygpu.launch.worker.main import _print_error

    lost = CollectiveTimeoutError(1, "all_reduce", 30.0, GLOO_LOST)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "/nonexistent/error.json")
    for wanted, shown in (("0", ""), ("1", "GLHF")):
        monkeypatch.setenv("MANYGPU_TRACEBACK", wanted)
        try:
            raise lost from RuntimeError(GLOO_LOST + " GLHF!")
        except CollectiveTimeoutError as exc:
            _print_error(exc)
        err = capsys.readouterr().err
        assert (shown in err) if shown else err == "", err


def test_a_lost_peer_is_named_from_the_hosts_file_only() -> None:
    hosts = "127.0.0.1 localhost\n# 10.213.0.2 old\n10.213.0.2\tnode1 node1.cluster  # ours\n"
    assert blame.hosts_file_names("10.213.0.2", hosts) == ["node1", "node1.cluster"]
    assert blame.hosts_file_names("10.213.0.9", hosts) == []


def test_the_lost_peers_line_names_remote_hosts_never_this_one() -> None:
    hosts = "10.213.0.2 node1\n"
    here = {"10.213.0.1"}.__contains__
    line = blame.lost_peers_line([1, 0], [GLOO_LOST], here, hosts)
    assert line.startswith("the first failure was on the host(s) at 10.213.0.2 (node1), not here")
    assert "ranks 0, 1 of this node" in line
    local = GLOO_LOST.replace("10.213.0.2", "10.213.0.1")  # rank 1 here closed after failing
    both = blame.lost_peers_line([0, 1], [local, GLOO_LOST], here, hosts)
    assert both.startswith("the first failure was on the host(s) at 10.213.0.2 (node1), not")
    own = blame.lost_peers_line([0], [local], here, "")
    assert own.startswith("the first failure was not here: rank 0 of this node lost")
    unnamed = blame.lost_peers_line([0], ["Timed out"], here, hosts)
    assert unnamed.startswith("the first failure was not here")


def _o(rank: int, t: int, consequence: bool = False) -> blame.Outcome:
    return blame.Outcome(rank, 1, t, consequence, "failed with exit code 1")


USAGE = "failed with exit code 1: UsageError: unknown strategy 'fdsp'; did you mean 'fsdp'?"


def test_the_same_configuration_error_on_every_rank_is_one_line_without_its_class() -> None:
    lines = blame.report_lines([(f"rank 1 {USAGE}", _o(1, 5)), (f"rank 0 {USAGE}", _o(0, 7))])
    assert lines == ["ranks 0, 1: unknown strategy 'fdsp'; did you mean 'fsdp'?"]


def test_only_ranks_that_failed_because_of_another_are_consequences() -> None:
    boom = "failed with exit code 1: ValueError: boom"
    lines = blame.report_lines(
        [
            ("rank 2 failed with exit code 1: KeyError: 'x'", _o(2, 9)),
            (f"rank 0 {boom}", _o(0, 5)),
            ("rank 3 was killed by SIGTERM", _o(3, 8, consequence=True)),
            (f"rank 1 {boom}", _o(1, 6)),
            ("rank 4 was killed by SIGTERM", _o(4, 8, consequence=True)),
        ]
    )
    assert lines == [
        f"ranks 0, 1 {boom}",
        "  then (a consequence) ranks 3, 4 were killed by SIGTERM",
        "  also rank 2 failed with exit code 1: KeyError: 'x'",
    ]


def test_a_configuration_error_merges_over_hosts_other_errors_keep_their_host() -> None:
    lines = blame.report_lines(
        [
            (f"10.0.0.1: rank 0 {USAGE}", _o(0, 5)),
            (f"10.0.0.2: rank 1 {USAGE}", _o(1, 6)),
            ("10.0.0.3: stopped (exit code 143)", _o(-1, 7, consequence=True)),
        ]
    )
    assert lines == [
        "ranks 0, 1: unknown strategy 'fdsp'; did you mean 'fsdp'?",  # one line, every host
        "  then (a consequence) 10.0.0.3: stopped (exit code 143)",
    ]
    boom = "failed with exit code 1: ValueError: boom"
    lines = blame.report_lines(
        [(f"10.0.0.1: rank 0 {boom}", _o(0, 5)), (f"10.0.0.2: rank 1 {boom}", _o(1, 6))]
    )
    assert lines == [f"10.0.0.1: rank 0 {boom}", f"  also 10.0.0.2: rank 1 {boom}"]


def test_without_a_lead_every_group_is_a_consequence() -> None:
    lost = "failed with exit code 1: RuntimeError: Connection closed by peer"
    entries = [(f"rank {r} {lost}", _o(r, 5 + r, consequence=True)) for r in range(4)]
    assert blame.report_lines(entries, lead=False) == [f"  then (a consequence) ranks 0-3 {lost}"]
