"""The job secret and the store's gate: who may talk to a job's stores.

Real sockets and a real TCPStore on loopback, in this process (the gate and
the door are threads); the emulated-host test of the same thing from another
host is tests/cluster/test_cluster_exposure.py.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime import secret as secretmod
from manygpu.runtime import store_gate
from manygpu.runtime.secret import JobSecret

SECRET = JobSecret.from_text("s" * 32, "test")
OTHER = JobSecret.from_text("o" * 32, "test")


@pytest.fixture
def gated() -> Iterator[tuple[TCPStore, store_gate.Gate, list[str]]]:
    """A store on loopback behind a gate keyed by SECRET; the lines the gate logs."""
    refused: list[str] = []
    inner = store_gate.listen("127.0.0.1", 0)
    port = int(inner.getsockname()[1])
    gate = store_gate.Gate(SECRET.gate_key, store_gate.listen("127.0.0.1", 0), port, refused.append)
    store = TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        timeout=timedelta(seconds=10),
        master_listen_fd=inner.detach(),
        use_libuv=True,
    )
    yield store, gate, refused
    gate.close()


def _door(secret: JobSecret, gate: store_gate.Gate, errors: list[str]) -> store_gate.Door:
    return store_gate.Door(secret.gate_key, "127.0.0.1", gate.port, 5.0, errors.append)


def test_a_holder_of_the_secret_uses_the_store_through_its_door(gated: tuple) -> None:
    store, gate, refused = gated
    errors: list[str] = []
    door = _door(SECRET, gate, errors)
    door.check()
    client = TCPStore("127.0.0.1", door.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v" and client.get("k") == b"v"
    assert client.add("n", 2) == 2
    assert refused == [] and errors == []


def test_a_wrong_secret_is_refused_at_once_and_named_once(gated: tuple) -> None:
    store, gate, refused = gated
    store.set("private", "value")
    errors: list[str] = []
    door = _door(OTHER, gate, errors)
    for _ in range(3):
        with pytest.raises(store_gate.DoorRefused, match="refused this node's job secret"):
            door.check()
    assert len(refused) == 1, refused  # one line per address, however often it knocks
    assert "from 127.0.0.1:" in refused[0] and "does not hold the job's secret" in refused[0]


def test_a_plain_store_client_gets_nothing_through_the_gate(gated: tuple) -> None:
    store, gate, refused = gated
    store.set("private", "value")
    with pytest.raises(Exception):  # noqa: B017 - torch raises DistNetworkError or a timeout
        client = TCPStore("127.0.0.1", gate.port, is_master=False, timeout=timedelta(seconds=3))
        client.list_keys()
    assert store.get("private") == b"value" and refused


def test_a_raw_peer_sees_only_a_nonce_then_is_closed(gated: tuple) -> None:
    _, gate, refused = gated
    with socket.create_connection(("127.0.0.1", gate.port), timeout=5) as sock:
        hello = sock.recv(len(store_gate.MAGIC) + store_gate.NONCE)
        sock.sendall(store_gate.MAGIC + os.urandom(store_gate.NONCE + store_gate.DIGEST))
        assert sock.recv(100) == b""  # closed, nothing relayed
    assert hello.startswith(store_gate.MAGIC)
    assert refused


def test_a_door_will_not_talk_to_an_impostor_gate() -> None:
    """A gate keyed otherwise cannot prove the key: the node learns it reached the wrong store."""
    inner = store_gate.listen("127.0.0.1", 0)
    impostor = store_gate.Gate(
        OTHER.gate_key, store_gate.listen("127.0.0.1", 0), inner.getsockname()[1], lambda _: None
    )
    try:
        with pytest.raises(store_gate.DoorRefused):
            _door(SECRET, impostor, []).check()
    finally:
        impostor.close()
        inner.close()


def test_run_ids_are_derived_alike_and_differ_per_secret() -> None:
    assert SECRET.run_id("x") == JobSecret(SECRET.value).run_id("x")
    assert SECRET.run_id("x") != OTHER.run_id("x") != OTHER.run_id("y")
    assert SECRET.run_id("x").startswith("manygpu-") and "s" * 8 not in SECRET.run_id("x")
    assert SECRET.derive("a") != SECRET.derive("b") and SECRET.gate_key == SECRET.derive(
        "store-gate"
    )
    assert "sss" not in repr(SECRET) and len(JobSecret.draw().value) == 64


def test_where_the_secret_comes_from(tmp_path: Path) -> None:
    assert secretmod.load(None, {}) is None
    assert secretmod.load(None, {envmod.JOB_SECRET: "e" * 20}) == JobSecret(b"e" * 20)
    with pytest.raises(UsageError, match="at least 16"):
        secretmod.load(None, {envmod.JOB_SECRET: "short"})
    path = tmp_path / "secret"
    path.write_text("f" * 40 + "\n")
    path.chmod(0o644)
    with pytest.raises(UsageError, match=f"chmod 600 {path}"):
        secretmod.load(str(path), {})
    path.chmod(0o600)
    assert secretmod.load(str(path), {envmod.JOB_SECRET: "e" * 20}) == JobSecret(b"f" * 40)


def test_only_jobs_that_meet_beyond_loopback_need_one() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert not secretmod.required(host), host
    for host in ("10.0.0.1", "node0", "fd00::1", "0.0.0.0"):
        assert secretmod.required(host), host


def test_forwarded_variables_are_names_and_never_the_secret() -> None:
    env = {"NCCL_DEBUG": "INFO", envmod.JOB_SECRET: "x" * 20, "HOME": "/root"}
    assert envmod.forwarded(env) == {"NCCL_DEBUG": "INFO"}
    with pytest.raises(UsageError, match=r"'NCCL_\$\(touch /tmp/x\)X' .* not a variable name"):
        envmod.forwarded({"NCCL_$(touch /tmp/x)X": "1"})
