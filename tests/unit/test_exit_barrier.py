"""The exit barrier where nodes wait for each other (launch/exit_barrier.py).

On real in-process TCPStores (a server and a client, as a node that hosts the job's
store and one that does not): a node that finished, waiting in torch's barrier or
in ours, is let go when a failed one counts out; ours gives up at its timeout, and
ends at once on a signal (torch's held it until the barrier opened); a store whose
host is gone is a ``False`` in seconds, not the barrier's 300 s. The whole path
through two launchers: tests/launch/test_launch_exit.py.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from types import FrameType

import pytest
from dist_harness import free_port
from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.utils import store as store_util

from manygpu.launch.exit_barrier import count_out, wait


def _stores() -> tuple[TCPStore, TCPStore]:
    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    return host, TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def test_a_node_waiting_in_the_exit_barrier_is_let_go_when_the_failed_one_counts_out() -> None:
    host, failed = _stores()
    done: list[float] = []

    def finished_node() -> None:  # what torch's agent does once its workers succeeded
        store_util.barrier(host, 2, agent_api._TERMINAL_STATE_SYNC_ID, barrier_timeout=20)
        done.append(time.monotonic())

    waiter = threading.Thread(target=finished_node, daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert not done, "the barrier opened with one node of two"
    counted = time.monotonic()
    assert count_out(failed, 2)
    waiter.join(timeout=10)
    assert done and done[0] - counted < 5


def test_counting_out_alone_leaves_the_barrier_closed_for_the_others() -> None:
    host, failed = _stores()
    assert count_out(failed, 3)
    with pytest.raises(RuntimeError):  # still one node short: torch's timeout, as before
        store_util.barrier(host, 3, agent_api._TERMINAL_STATE_SYNC_ID, barrier_timeout=1)


def test_a_store_whose_host_is_gone_is_a_false_in_the_count_s_timeout() -> None:
    host, failed = _stores()
    del host  # the node that served the store has ended
    start = time.monotonic()
    assert not count_out(failed, 2, timeout_s=2)
    assert time.monotonic() - start < 10


def test_our_wait_is_let_go_by_a_count_out_and_gives_up_at_its_timeout() -> None:
    host, failed = _stores()
    threading.Timer(0.5, count_out, (failed, 2)).start()
    assert wait(host, 2, timeout_s=20, poll_s=0.05)
    other, _ = _stores()
    start = time.monotonic()
    assert not wait(other, 2, timeout_s=1, poll_s=0.05)
    assert 1 <= time.monotonic() - start < 5


class _Stopped(Exception):
    pass


def test_a_signal_ends_our_wait_at_once() -> None:
    """torch's agent raises from its signal handler; Python runs it between the polls."""
    host, _ = _stores()

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stopped

    previous = signal.signal(signal.SIGALRM, stop)
    start = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Stopped):
            wait(host, 2, timeout_s=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - start < 3


def test_our_wait_on_a_store_whose_host_is_gone_is_a_false() -> None:
    host, other = _stores()
    del host
    start = time.monotonic()
    assert not wait(other, 2, timeout_s=30)
    assert time.monotonic() - start < 10
