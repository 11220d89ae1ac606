"""The launcher's port pre-check agrees with the store's own bind.

A job that just ended leaves its rendezvous port in TIME_WAIT for up to a
minute; the store (``rendezvous.listen_fd``, like torch's TCPStore) binds it
with SO_REUSEADDR, so the next job on the same port must not be refused as
"already in use". A live listener still is.
"""

from __future__ import annotations

import socket

import pytest

from manygpu.errors import UsageError
from manygpu.launch.netcheck import check_port_free


def _port_in_time_wait() -> int:
    """A loopback port whose server side closed first: it stays in TIME_WAIT."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the store's side closes first
    client.close()
    return int(port)


def test_a_port_in_time_wait_is_free_for_the_next_job() -> None:
    port = _port_in_time_wait()
    # The state the old check (a bind without SO_REUSEADDR) tripped over.
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    check_port_free("127.0.0.1", port)  # no exception


def test_a_listener_on_a_time_wait_port_is_still_a_clash() -> None:
    port = _port_in_time_wait()
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(UsageError, match=f"master port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
