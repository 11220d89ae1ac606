"""The c10d rendezvous state: a non-member's writes never run code, only end the job.

torch's own backend is run beside ours on the same payload to prove the payload
does run code where it is unpickled (so the refusal below is real).
"""

from __future__ import annotations

import base64
import contextlib
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from rdzv_attack import payload
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from manygpu.launch import rdzv_state
from manygpu.launch.rendezvous import JsonStateBackend, serve_store
from manygpu.runtime.secret import JobSecret


@pytest.fixture
def store() -> TCPStore:
    return serve_store("127.0.0.1", 0, timedelta(seconds=5))


def _holder(backend: object) -> _BackendRendezvousStateHolder:
    """torch's own state holder, which unpickles what its backend returns."""
    settings = RendezvousSettings("job", 1, 2, RendezvousTimeout(), timedelta(seconds=5), 3)
    return _BackendRendezvousStateHolder(backend, settings, cache_duration=0)  # type: ignore[arg-type]


def _client(store: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))


def _state() -> _RendezvousState:
    now = datetime.now(timezone.utc)
    a, b, c = (
        _NodeDesc("10.0.0.1", 41, 0),
        _NodeDesc("node-b.cluster", 77, 3),
        _NodeDesc("::1", 9, 1),
    )
    state = _RendezvousState()
    state.round, state.complete, state.deadline = 4, True, now + timedelta(seconds=30)
    state.participants = {a: 0, b: 1}
    state.wait_list, state.redundancy_list = {c}, {b}
    state.last_heartbeats = {a: now, b: now - timedelta(seconds=2)}
    return state


def test_torchs_backend_runs_the_payload(store: TCPStore, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    backend = C10dRendezvousBackend(store, "job")
    _client(store).set("torch.rendezvous.job", base64.b64encode(payload(str(marker))))
    with contextlib.suppress(Exception):  # the payload is no state; what matters is it ran
        _holder(backend).sync()
    assert marker.exists()


@pytest.mark.parametrize("encode", [base64.b64encode, lambda b: b], ids=["base64", "raw"])
def test_ours_refuses_the_payload_without_running_it(
    store: TCPStore, tmp_path: Path, encode: object
) -> None:
    marker = tmp_path / "ran"
    backend = JsonStateBackend(store, "job", "127.0.0.1:1")
    _client(store).set("manygpu.rendezvous.job", encode(payload(str(marker))))  # type: ignore[operator]
    with pytest.raises(RendezvousStateError, match=r"not manygpu's .*not JSON.*private network"):
        _holder(backend).sync()
    assert not marker.exists()


def test_state_survives_the_round_trip(store: TCPStore) -> None:
    """A state written by one member is read back field for field by another."""
    writer, reader = (
        JsonStateBackend(store, "job", "w"),
        JsonStateBackend(_client(store), "job", "r"),
    )
    state = _state()
    holder = _holder(writer)
    holder._state, holder._dirty = state, True
    holder.sync()
    other = _holder(reader)
    other.sync()
    got = other.state
    assert (got.round, got.complete, got.deadline, got.closed) == (4, True, state.deadline, False)
    assert got.participants == state.participants and got.last_heartbeats == state.last_heartbeats
    assert got.wait_list == state.wait_list and got.redundancy_list == state.redundancy_list


def test_compare_and_set_sees_a_stale_token(store: TCPStore) -> None:
    """A write based on an old read loses, and the winner's state is returned."""
    one, two = JsonStateBackend(store, "job", "1"), JsonStateBackend(_client(store), "job", "2")
    first = _state()
    _, token, won = one.set_state(rdzv_state.to_local_pickle(first))  # type: ignore[misc]
    assert won
    second = _state()
    second.round = 9
    assert two.set_state(rdzv_state.to_local_pickle(second), token)[2]  # type: ignore[index]
    third = _state()
    third.round = 11
    result = one.set_state(rdzv_state.to_local_pickle(third), token)  # stale token
    assert result is not None and not result[2]
    assert rdzv_state.from_local_pickle(result[0]).round == 9


def _doc(**change: object) -> bytes:
    doc = json.loads(rdzv_state.encode(_state()))
    doc.update(change)
    return json.dumps(doc).encode()


BAD = {
    "not json": b"\x80\x04\x95",
    "a list": b"[]",
    "no schema": _doc(schema=None),
    "negative round": _doc(round=-1),
    "round as text": _doc(round="4"),
    "huge round": _doc(round=2**80),
    "complete as 1": _doc(complete=1),
    "bad deadline": _doc(deadline="tomorrow"),
    "local deadline": _doc(deadline="2026-11-23T10:00:00+02:00"),
    "participants dict": _doc(participants={"a": 0}),
    "short node": _doc(wait_list=[["a", 1]]),
    "empty addr": _doc(wait_list=[["", 1, 0]]),
    "long addr": _doc(wait_list=[["x" * 300, 1, 0]]),
    "float pid": _doc(wait_list=[["a", 1.5, 0]]),
    "bad heartbeat": _doc(last_heartbeats=[["a", 1, 0, 5]]),
    "oversized": b" " * (rdzv_state.MAX_BYTES + 1),
}


@pytest.mark.parametrize("raw", BAD.values(), ids=BAD.keys())
def test_malformed_state_is_refused_in_one_line(raw: bytes) -> None:
    with pytest.raises(RendezvousStateError, match="not manygpu's") as info:
        rdzv_state.decode(raw, "127.0.0.1:29400")
    assert "\n" not in str(info.value)


def test_local_pickles_are_allow_listed(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(Exception, match="not part of a rendezvous state"):
        rdzv_state.from_local_pickle(payload(str(marker)))
    assert not marker.exists()


def test_with_a_secret_an_unsigned_state_is_named_and_replaced_not_fatal(
    store: TCPStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A well-formed state nobody of the job signed (a local user of the store's
    host wrote it) neither ends nor stalls the rendezvous: the next write wins."""
    secret = JobSecret(b"k" * 32)
    marker = tmp_path / "ran"
    member = JsonStateBackend(store, "job", "127.0.0.1:1", secret)
    forged = _state()
    forged.round = 77
    for bits in (rdzv_state.encode(forged).encode(), payload(str(marker))):
        _client(store).set("manygpu.rendezvous.job", bits)
        holder = _holder(member)
        holder.sync()  # read: taken as empty, not as round 77, no error
        assert holder.state.round == 0 and not holder.state.participants
        mine = _state()
        holder._state, holder._dirty = mine, True
        holder.sync()  # written over the forged one
        other = _holder(JsonStateBackend(_client(store), "job", "r", secret))
        other.sync()
        assert other.state.round == mine.round and other.state.participants == mine.participants
    assert not marker.exists()
    err = capsys.readouterr().err
    assert err.count("no node of this job signed") == 1, err  # named once per backend
    # A member without the secret (or with another) cannot read the signed state as its own.
    stranger = _holder(JsonStateBackend(_client(store), "job", "s", JobSecret(b"x" * 32)))
    stranger.sync()
    assert stranger.state.round == 0
