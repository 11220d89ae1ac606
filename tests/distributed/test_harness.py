"""The rank harness itself: every way a rank can fail ends the test cleanly, and says how."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from dist_harness import run_ranks

from manygpu import Parallel


def _fails_on(rank: int, how: str, pid_dir: str = "") -> int:
    par = Parallel(strategy="ddp", timeout_s=60)
    if pid_dir:
        Path(pid_dir, f"pid{par.rank}").write_text(str(os.getpid()))
    if par.rank == rank:
        if how == "raise":
            raise ValueError(f"boom from rank {rank}")
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(120)
    par.barrier()  # the others wait for the failing rank here
    return par.rank


def _gone(pid_dir: Path) -> bool:
    pids = [int(p.read_text()) for p in pid_dir.glob("pid*")]
    return bool(pids) and not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    )


def _environment() -> dict[str, object]:
    return {
        "probe": os.environ.get("HARNESS_PROBE"),
        "rank": os.environ["RANK"],
        "world": os.environ["WORLD_SIZE"],
        "ifname": os.environ["GLOO_SOCKET_IFNAME"],
        "threads": torch.get_num_threads(),
        "extra": os.environ.get("HARNESS_EXTRA"),
        "seed": torch.initial_seed(),
    }


def test_ranks_see_the_tests_environment_and_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a freshly started process would: the test's variables, torchrun's, one thread."""
    monkeypatch.setenv("HARNESS_PROBE", "from the test")
    results = run_ranks(_environment, 2, extra_env={"HARNESS_EXTRA": "x"})
    for rank, got in enumerate(results):
        assert got["probe"] == "from the test" and got["extra"] == "x"
        assert (got["rank"], got["world"], got["ifname"]) == (str(rank), "2", "lo")
        assert got["threads"] == 1
    # Each rank draws its own seed, as a new process does: forked ranks must not
    # share one, or a test of "prepare makes replicas equal" would pass by luck.
    assert results[0]["seed"] != results[1]["seed"]


def test_a_raising_rank_fails_the_test_with_its_traceback() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_fails_on, 2, 1, "raise", timeout=60)
    message = str(info.value)
    assert "[rank 1] Traceback" in message  # rank 0 fails too, in the barrier
    assert "ValueError: boom from rank 1" in message


@pytest.mark.parametrize("how, words", [("exit", "exited with code 3"), ("kill", "SIGKILL")])
def test_a_dead_rank_is_named_at_once(tmp_path: Path, how: str, words: str) -> None:
    """Not after the timeout: the rank left waiting in the barrier is stopped."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=rf"\[rank 1\] .*{words} before answering"):
        run_ranks(_fails_on, 3, 1, how, str(tmp_path), timeout=60)
    assert time.monotonic() - start < 30
    assert _gone(tmp_path), "a rank outlived the test"


def test_a_hung_rank_fails_after_the_timeout_and_is_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] gave no answer within 3s"):
        run_ranks(_fails_on, 2, 1, "hang", str(tmp_path), timeout=3)
    assert time.monotonic() - start < 15
    assert _gone(tmp_path), "a hung rank outlived the test"
