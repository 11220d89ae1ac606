"""A failed node counts itself out of torch's exit barrier (launch/exit_barrier.py).

On real in-process TCPStores (a server and a client, as a node that hosts the job's
store and one that does not): the node that finished waits in torch's own barrier
and is let go when the failed one counts out; a store whose host is gone is
answered with ``False`` in the count's timeout, not the barrier's 300 s. The whole
path through two launchers: tests/launch/test_launch_exit.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from dist_harness import free_port
from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.utils import store as store_util

from manygpu.launch.exit_barrier import count_out


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
