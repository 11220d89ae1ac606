"""notebook_launcher's refusals and its choice of the rank to blame, without processes
(the workers themselves: tests/launch/test_notebook_kernel.py, through a real notebook)."""

from __future__ import annotations

import pytest
import torch

from manygpu import LaunchError, UsageError, notebook_launcher
from manygpu.launch.notebook import _Ended, _failure


def _never(*_: object) -> None:
    raise AssertionError("no worker may start")


def test_initialised_cuda_is_refused_in_one_line_before_any_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr("multiprocessing.context.ForkContext.Process", _never)
    with pytest.raises(UsageError, match=r"^notebook_launcher: CUDA is already initialised") as e:
        notebook_launcher(print, nproc=2)
    assert "\n" not in str(e.value) and "restart the kernel" in str(e.value)


@pytest.mark.parametrize("nproc", [0, -1, "2", True, 1.5])
def test_a_bad_worker_count_is_one_line(nproc: object) -> None:
    with pytest.raises(UsageError, match=r"notebook_launcher: nproc=.*give a number of workers"):
        notebook_launcher(print, nproc=nproc)  # type: ignore[arg-type]


def test_the_rank_that_failed_on_its_own_is_blamed_not_the_peer_that_lost_it() -> None:
    ended = {
        0: _Ended("error", error="PeerLostError: rank 0: ...", consequence=True, time_ns=1),
        1: _Ended("error", error="ValueError: boom", trace="Traceback ...", time_ns=2),
    }
    err = _failure(ended, {0: (1, 5), 1: (1, 6)})
    assert isinstance(err, LaunchError) and err.exit_code == 1
    assert str(err) == "notebook_launcher: rank 1 failed: ValueError: boom"
    assert "rank 1's traceback:\nTraceback ..." in str(err.__cause__)
    # A rank killed (the OOM killer's SIGKILL) leaves no message: still the cause, and
    # the ranks the launcher stopped with SIGTERM are not.
    err = _failure({}, {0: (-15, 9), 1: (-9, 8), 2: (0, 7)})
    assert str(err) == "notebook_launcher: rank 1 was killed by SIGKILL" and err.exit_code == 137
