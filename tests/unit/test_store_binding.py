"""Where rank 0's store listens when srun or mpirun started the job (no launcher, no agent)."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import pytest
from jobs import two_rank_cluster

from manygpu.errors import UsageError
from manygpu.runtime.job_store import listen_fd, store_host


def test_one_node_meets_on_loopback_and_several_on_master_addr() -> None:
    one = replace(two_rank_cluster(), master_addr="node01")
    assert store_host(replace(one, source="slurm")) == "127.0.0.1"
    assert store_host(replace(one, source="mpi")) == "127.0.0.1"
    two_nodes = replace(one, source="slurm", world_size=4)  # 2 ranks here, 4 in all
    assert store_host(two_nodes) == "node01"
    assert store_host(one) == "node01"  # started by hand: the address it was given


def test_the_socket_listens_on_that_address_only() -> None:
    fd = listen_fd("127.0.0.1", 0)
    with socket.socket(fileno=fd) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"


def test_a_loopback_master_for_several_nodes_is_one_line_naming_rank_0() -> None:
    with pytest.raises(UsageError) as info:
        listen_fd("localhost", 0, reachable=True)
    text = str(info.value)
    assert "\n" not in text and text.startswith("rank 0 cannot host the job's store")
    assert "loopback" in text and "MASTER_ADDR" in text


def test_a_taken_port_is_one_line_naming_rank_0() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UsageError, match=rf"^rank 0 cannot host .*:{port}: the port is taken"):
            os.close(listen_fd("127.0.0.1", port))
