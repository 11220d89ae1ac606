"""The elastic rendezvous state as strict JSON, so no peer can make us run code.

torch's c10d rendezvous keeps ``_RendezvousState`` in the store as a pickle and
every agent unpickles what it reads back: anyone who can reach the store can
write a pickle that runs as the launching user. Here the store holds JSON
that is checked field by field; the pickles torch's state holder exchanges with
its backend never leave this process (:func:`from_local_pickle` reads only the
holder's own bytes, and even those through an allow-list).
"""

from __future__ import annotations

import io
import json
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

SCHEMA = "manygpu-rdzv/1"
MAX_BYTES = 4 << 20
"""Largest state we read (a job of 10,000 nodes takes well under 2 MiB)."""
MAX_ADDR = 255
_MAX_INT = 2**62

_DYN = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_ALLOWED = {
    (_DYN, "_RendezvousState"),
    (_DYN, "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
}


class _StateUnpickler(pickle.Unpickler):
    """Builds only rendezvous state: anything else is refused, not imported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state")


def from_local_pickle(bits: bytes) -> _RendezvousState:
    """The state torch's holder pickled in this process (allow-listed anyway)."""
    state = _StateUnpickler(io.BytesIO(bits)).load()
    if not isinstance(state, _RendezvousState):
        raise RendezvousStateError("the rendezvous holder passed something other than its state")
    return state


def to_local_pickle(state: _RendezvousState) -> bytes:
    """Bytes for torch's holder, which unpickles whatever its backend returns."""
    return pickle.dumps(state)


def _node(n: _NodeDesc) -> list[Any]:
    return [n.addr, n.pid, n.local_id]


def _time(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat()


def empty() -> _RendezvousState:
    """A state with nobody in it, as torch starts from."""
    return _RendezvousState()


def encode(state: _RendezvousState) -> str:
    """Canonical JSON (sorted), so equal states give equal text."""
    doc = {
        "schema": SCHEMA,
        "round": state.round,
        "complete": state.complete,
        "deadline": None if state.deadline is None else _time(state.deadline),
        "closed": state.closed,
        "participants": sorted([*_node(n), r] for n, r in state.participants.items()),
        "wait_list": sorted(_node(n) for n in state.wait_list),
        "redundancy_list": sorted(_node(n) for n in state.redundancy_list),
        "last_heartbeats": sorted([*_node(n), _time(t)] for n, t in state.last_heartbeats.items()),
    }
    return json.dumps(doc, separators=(",", ":"))


class _Bad(ValueError):
    """One field of the state is not what we wrote."""


def _int(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < _MAX_INT:
        raise _Bad(f"{what} is not a small non-negative integer")
    return value


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise _Bad(f"{what} is not true/false")
    return value


def _when(value: Any, what: str) -> datetime:
    if not isinstance(value, str) or len(value) > 40:
        raise _Bad(f"{what} is not a time")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise _Bad(f"{what} is not a time") from None
    if parsed.utcoffset() != timedelta(0):
        raise _Bad(f"{what} is not in UTC")
    return parsed


def _node_from(item: Any, what: str, extra: int = 0) -> tuple[_NodeDesc, list[Any]]:
    if not isinstance(item, list) or len(item) != 3 + extra:
        raise _Bad(f"{what} entry is not [addr, pid, local_id{', …' if extra else ''}]")
    addr = item[0]
    if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR:
        raise _Bad(f"{what} entry has a bad address")
    node = _NodeDesc(addr, _int(item[1], f"{what} pid"), _int(item[2], f"{what} local_id"))
    return node, item[3:]


def _list(doc: dict[str, Any], key: str) -> list[Any]:
    value = doc.get(key)
    if not isinstance(value, list):
        raise _Bad(f"{key} is not a list")
    return value


def _build(doc: Any) -> _RendezvousState:
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise _Bad(f"it is not a {SCHEMA} document")
    state = _RendezvousState()
    state.round = _int(doc.get("round"), "round")
    state.complete = _bool(doc.get("complete"), "complete")
    state.closed = _bool(doc.get("closed"), "closed")
    deadline = doc.get("deadline")
    state.deadline = None if deadline is None else _when(deadline, "deadline")
    for item in _list(doc, "participants"):
        node, (rank,) = _node_from(item, "participants", extra=1)
        state.participants[node] = _int(rank, "participant rank")
    state.wait_list = {_node_from(i, "wait_list")[0] for i in _list(doc, "wait_list")}
    state.redundancy_list = {
        _node_from(i, "redundancy_list")[0] for i in _list(doc, "redundancy_list")
    }
    for item in _list(doc, "last_heartbeats"):
        node, (when,) = _node_from(item, "last_heartbeats", extra=1)
        state.last_heartbeats[node] = _when(when, "heartbeat")
    return state


def decode(raw: bytes, where: str) -> _RendezvousState:
    """Parse and check state read from the store; refuse anything we would not write."""
    try:
        if len(raw) > MAX_BYTES:
            raise _Bad(f"it is {len(raw)} bytes, over {MAX_BYTES}")
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _Bad("it is not JSON") from None
        return _build(doc)
    except _Bad as bad:
        raise foreign_write(f"the rendezvous state at {where}", str(bad)) from None


def foreign_write(what: str, why: str) -> RendezvousStateError:
    """The one message for anything in the store that this job did not write."""
    return RendezvousStateError(
        f"{what} is not manygpu's ({why}): a program that is not part of this job wrote to "
        "the store; keep the rendezvous port on a private network and give the job a fresh "
        "--rdzv-id"
    )
