"""Rendezvous for ``manygpu launch``: JSON state, stores that listen on one address.

torch's own handlers ("c10d", "static") create their ``TCPStore`` servers on
every address of the machine, and the c10d one unpickles the shared state.
Ours are the same handlers with these changes: every store server listens only
on the address the job meets on (loopback for one node, the interface asked
for with several); the c10d state is JSON (:mod:`manygpu.launch.rdzv_state`);
and a job with a secret (every job that meets over the network) keeps both of
its stores, the rendezvous one and the workers' bootstrap one, on loopback
behind a :class:`~manygpu.runtime.store_gate.Gate`, reached from every node
(this one included) through a local :class:`~manygpu.runtime.store_gate.Door`.
The run id is then derived from the secret, never published.
They are registered under their own names so torch's stay untouched.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import re
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from manygpu.launch import rdzv_state
from manygpu.launch.netcheck import is_local_address
from manygpu.launch.spec import AGREED_ID
from manygpu.runtime import store_gate
from manygpu.runtime.secret import JobSecret

RUN_ID_KEY = "manygpu.run_id"
JOINED_KEY = "manygpu.joined"
"""``{JOINED_KEY}.{run_id}.{node rank}``: how many times that node has joined this store."""
STALE_POLL_S = 1.0
_RUN_ID = re.compile(r"manygpu-[0-9a-f]{16}")
C10D = "manygpu-c10d"
STATIC = "manygpu-static"
BACKENDS = {"c10d": C10D, "static": STATIC}
"""The user's ``--rdzv-backend`` name → the handler we register for it."""


def listen_fd(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only; the caller's store owns the fd."""
    return store_gate.listen(host, port).detach()


def serve_store(host: str, port: int, timeout: timedelta, **kwargs: Any) -> TCPStore:
    """A store server on ``host:port`` alone (never on the wildcard address)."""
    return TCPStore(
        host,
        port,
        is_master=True,
        timeout=timeout,
        master_listen_fd=listen_fd(host, port),
        use_libuv=True,
        **kwargs,
    )


class _Job:
    """This launcher's job secret, set by :func:`register` before the agent starts,
    and the store its handler joined (for the hang watch's messages between hosts).

    torch builds handlers from ``RendezvousParameters``, whose settings it logs;
    the secret stays out of them, here in the one process that launches.
    """

    secret: JobSecret | None = None
    store: Store | None = None
    hosting: bool = False
    run_id: str = ""


def hang_channel() -> tuple[Store, bool, str] | None:
    """The job's store once joined, whether this node hosts it, and the hang keys' prefix."""
    if _Job.store is None:
        return None
    return _Job.store, _Job.hosting, f"manygpu.hang.{_Job.run_id}"


def _joined(store: Store, hosting: bool, run_id: str) -> str:
    _Job.store, _Job.hosting, _Job.run_id = store, hosting, run_id
    return run_id


@dataclass
class GatedStore:
    """A store on loopback and the gate that admits the job's nodes to it."""

    store: TCPStore
    gate: store_gate.Gate

    @property
    def port(self) -> int:
        """The gate's port: what the other nodes are told."""
        return int(self.gate.port)


def serve_gated(
    secret: JobSecret, host: str, port: int, timeout: timedelta, **kwargs: Any
) -> GatedStore:
    """The store on loopback, its gate on ``host:port`` (bound first: a taken port fails here).

    The gate opens before the store is created: a store told the world size
    waits in its constructor for every node, and they come in through the gate.
    """
    public = store_gate.listen(host, port)
    inner = store_gate.listen("127.0.0.1", 0)
    inner_port = int(inner.getsockname()[1])
    gate = store_gate.Gate(secret.gate_key, public, inner_port)
    try:
        store = TCPStore(
            "127.0.0.1",
            inner_port,
            is_master=True,
            timeout=timeout,
            master_listen_fd=inner.detach(),
            use_libuv=True,
            **kwargs,
        )
    except BaseException:
        gate.close()
        raise
    return GatedStore(store=store, gate=gate)


def _client(host: str, port: int, timeout: timedelta, **kwargs: Any) -> TCPStore:
    """A store client of ``host:port``, through a door when the job has a secret."""
    secret = _Job.secret
    if secret is None:
        return TCPStore(host, port, is_master=False, timeout=timeout, **kwargs)
    try:
        entrance = _door(secret, host, port, timeout)
    except (store_gate.DoorRefused, ConnectionError) as exc:
        raise RendezvousConnectionError(str(exc)) from None
    return TCPStore("127.0.0.1", entrance.port, is_master=False, timeout=timeout, **kwargs)


def _door(secret: JobSecret, host: str, port: int, timeout: timedelta) -> store_gate.Door:
    return store_gate.open_door(secret.gate_key, host, port, timeout.total_seconds())


def _host(host: str, port: int, timeout: timedelta, **kwargs: Any) -> tuple[TCPStore, int]:
    """The store this node hosts and the port the others reach it on."""
    secret = _Job.secret
    if secret is None:
        store = serve_store(host, port, timeout, **kwargs)
        return store, store.port
    gated = serve_gated(secret, host, port, timeout, **kwargs)
    _KEEP.append(gated)
    return gated.store, gated.port


_KEEP: list[object] = []
"""Gates and doors live as long as the launcher (their threads are daemons)."""


class _Doors:
    """One local door per remote bootstrap store, for the workers of this node."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], int] = {}

    def through(self, info: RendezvousInfo, timeout: timedelta) -> RendezvousInfo:
        """``info`` with the workers' store reached through a door on loopback."""
        secret, remote = _Job.secret, info.bootstrap_store_info
        if secret is None or remote is None:
            return info
        key = (remote.master_addr, remote.master_port)
        if key not in self._open:
            # Unchecked: the workers' store may not be up yet; its clients retry.
            entrance = store_gate.Door(secret.gate_key, *key, timeout.total_seconds())
            self._open[key] = int(entrance.port)
        local = RendezvousStoreInfo(master_addr="127.0.0.1", master_port=self._open[key])
        return RendezvousInfo(info.store, info.rank, info.world_size, local)


def agree_run_id(store: Store, run_id: str, hosting: bool) -> str:
    """``run_id``, or for :data:`AGREED_ID` the random id the store's host drew.

    With a job secret, every node derives the same id from it (nothing is
    published). Without one (a job on loopback) nodes started one by one
    share nothing, so the host draws the id and the others read it from the
    store: every job gets a fresh id without any flag (a leftover agent of
    another job cannot join it).
    """
    if _Job.secret is not None:
        return _Job.secret.run_id(run_id)
    if run_id != AGREED_ID:
        return run_id
    if hosting:
        store.compare_set(RUN_ID_KEY, "", f"manygpu-{secrets.token_hex(8)}")
    value = store.get(RUN_ID_KEY).decode("utf-8", "replace")
    if not _RUN_ID.fullmatch(value):
        raise rdzv_state.foreign_write("the run id in the rendezvous store", repr(value[:40]))
    return value


class JsonStateBackend(RendezvousBackend):
    """torch's C10dRendezvousBackend with the state kept as checked JSON.

    With a job secret each state written is signed (HMAC-SHA256 of its text
    under a key derived from the secret). A state that fails the check was
    not written by a node of this job (the gate keeps strangers out; this
    covers a local user of the store's host, who can reach its loopback
    port): it is named once in the log and treated as an empty state whose
    token is that text, so the next write of a node replaces it. It can
    neither end the rendezvous nor stall it.
    """

    _NULL = "null"  # set first, so a plain ``get`` never blocks

    def __init__(
        self, store: Store, run_id: str, where: str, secret: JobSecret | None = None
    ) -> None:
        self._store = store
        self._key = f"manygpu.rendezvous.{run_id}"
        self._where = f"{where} (key {self._key})"
        self._mac_key = None if secret is None else secret.derive("rendezvous-state")
        self._named = False
        self._foreign: bytes | None = None
        self._call("compare_set", self._key, "", self._NULL)

    @property
    def name(self) -> str:
        return C10D

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._decode(self._call("get", self._key))

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, bytes):  # not one of ours: stale
            result = self.get_state()
            return None if result is None else (*result, False)
        text = self._sign(rdzv_state.encode(rdzv_state.from_local_pickle(state)))
        if token is not None and token == self._foreign:
            # Not ours and maybe not text (compare_set takes text): clear it if it
            # is still there, then write as onto an empty key.
            if self._call("get", self._key) == token:
                self._call("set", self._key, self._NULL)
            token = None
        expected = token.decode() if token is not None else self._NULL
        raw = self._call("compare_set", self._key, expected, text)
        pair = self._decode(raw)
        if pair is None:
            return None
        return pair[0], pair[1], raw == text.encode()

    def _sign(self, text: str) -> str:
        if self._mac_key is None:
            return text
        return f"{text}\n{hmac.new(self._mac_key, text.encode(), hashlib.sha256).hexdigest()}"

    def _decode(self, raw: bytes) -> tuple[bytes, Token] | None:
        if raw == self._NULL.encode():
            return None
        body = raw
        if self._mac_key is not None:
            body, _, sig = raw.rpartition(b"\n")
            good = hmac.new(self._mac_key, body, hashlib.sha256).hexdigest().encode()
            if not hmac.compare_digest(sig, good):
                self._name_foreign()
                self._foreign = raw
                return rdzv_state.to_local_pickle(rdzv_state.empty()), raw
        return rdzv_state.to_local_pickle(rdzv_state.decode(body, self._where)), raw

    def _name_foreign(self) -> None:
        if not self._named:
            self._named = True
            print(
                f"manygpu: ignored a rendezvous state at {self._where} that no node of this "
                "job signed (replaced by the next write)",
                file=sys.stderr,
                flush=True,
            )

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(
                f"lost the rendezvous store at {self._where}: {exc}"
            ) from exc


class _DynamicHandler(DynamicRendezvousHandler):
    """The workers' bootstrap store listens on this node's address only (behind a
    gate when the job has a secret; the workers then reach it through a door)."""

    _BOOTSTRAP_TIMEOUT = timedelta(seconds=300)

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        timeout, secret = self._BOOTSTRAP_TIMEOUT, _Job.secret
        if secret is None:
            return serve_store(master_addr, master_port, timeout, multi_tenant=True)
        # torch keeps what this returns and reads only its ``.port``, to tell the
        # other nodes where the workers' store is: the gate's port.
        return cast(
            TCPStore, serve_gated(secret, master_addr, master_port, timeout, multi_tenant=True)
        )

    def next_rendezvous(self) -> RendezvousInfo:
        if not hasattr(self, "_doors"):
            self._doors = _Doors()
        return self._doors.through(super().next_rendezvous(), self._BOOTSTRAP_TIMEOUT)


def _c10d_store(params: RendezvousParameters) -> tuple[TCPStore, str, bool]:
    """Host the store if the endpoint is ours (or ``is_host`` says so), else join it.

    As torch does, a host we only inferred falls back to joining when the port
    is taken: several launchers on one machine share the first one's store.
    """
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    configured = params.get_as_bool("is_host")
    if configured if configured is not None else is_local_address(host):
        try:
            store, served = _host(host, port, timeout, multi_tenant=True)
            return store, f"{host}:{served}", True
        except OSError as exc:
            if configured or exc.errno != errno.EADDRINUSE:
                raise RendezvousConnectionError(
                    f"cannot host the rendezvous store on {host}:{port}: {exc.strerror}"
                ) from None
    try:
        return _client(host, port, timeout), f"{host}:{port}", False
    except (RuntimeError, TimeoutError) as exc:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {host}:{port}: {exc}"
        ) from exc


def _timeouts(params: RendezvousParameters) -> RendezvousTimeout:
    def get(name: str) -> timedelta | None:
        seconds = params.get_as_int(f"{name}_timeout")
        return None if seconds is None else timedelta(seconds=seconds)

    return RendezvousTimeout(get("join"), get("last_call"), get("close"), get("heartbeat"))


def create_c10d(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler (same settings) with our store and state backend."""
    store, where, hosting = _c10d_store(params)
    run_id = _joined(store, hosting, agree_run_id(store, params.run_id, hosting))
    return _DynamicHandler.from_backend(
        run_id,
        store,
        JsonStateBackend(store, run_id, where, _Job.secret),
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        _timeouts(params),
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3,
    )


class _StaticHandler(StaticTCPRendezvous):
    """torch's static rendezvous; node 0's store listens on the master address only
    (behind a gate when the job has a secret; every node's workers then use a door)."""

    def get_backend(self) -> str:
        return STATIC

    def next_rendezvous(self) -> RendezvousInfo:
        if not self._store:
            kwargs: dict[str, Any] = {"world_size": self.world_size, "multi_tenant": True}
            if self.rank == 0:
                self._store = _host(self.master_addr, self.master_port, self.timeout, **kwargs)[0]
                run_id = agree_run_id(self._store, self.run_id, hosting=True)
            else:
                self._store, run_id = self._join_fresh(kwargs)
            self.run_id = _joined(self._store, self.rank == 0, run_id)
            self._doors = _Doors()
        return self._doors.through(super().next_rendezvous(), self.timeout)

    def _join_fresh(self, kwargs: dict[str, Any]) -> tuple[Store, str]:
        """Node 0's store, and the run id, once it is a store this node has not joined before.

        A node restarted on its own (a pod's container restarted by kubelet, a
        node requeued alone) can reach node 0's store of the run it left while
        node 0 has not yet noticed: its workers would then meet the old run's
        keys. A static store counts each node's joins; a second join here means
        the store is that old run's, and this node waits for node 0's next one.
        """
        deadline = time.monotonic() + self.timeout.total_seconds()
        told = False
        while True:
            store = _client(self.master_addr, self.master_port, self.timeout, **kwargs)
            run_id = agree_run_id(store, self.run_id, hosting=False)
            if store.add(f"{JOINED_KEY}.{run_id}.{self.rank}", 1) == 1:
                return store, run_id
            where = f"{self.master_addr}:{self.master_port}"
            if not told:
                told = True
                print(
                    f"manygpu: node {self.rank}: the rendezvous store at {where} is still the "
                    "previous run's (node 0 has not restarted yet); waiting for its next one "
                    f"(up to {self.timeout.total_seconds():.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            _wait_gone(store, deadline, where)


def _wait_gone(store: Store, deadline: float, where: str) -> None:
    """Until ``store`` fails (its host ended); a one-line error at ``deadline``."""
    while time.monotonic() < deadline:
        try:
            store.check([RUN_ID_KEY])
        except (RuntimeError, ValueError, TimeoutError):
            return
        time.sleep(STALE_POLL_S)
    raise RendezvousConnectionError(  # printed as it is, one line
        f"the rendezvous store at {where} is still the previous run's: node 0 has not "
        "restarted; restart it (or the whole job)"
    )


def create_static(params: RendezvousParameters) -> RendezvousHandler:
    """The static handler for ``params`` (fixed node count, node 0 hosts)."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    plain = cast(StaticTCPRendezvous, create_rdzv_handler(params))  # torch's checks
    seconds = int(plain.timeout.total_seconds())
    return _StaticHandler(
        plain.master_addr, plain.master_port, plain.rank, plain.world_size, plain.run_id, seconds
    )


def register(secret: JobSecret | None = None) -> None:
    """Make our handlers known to torch's registry (idempotent), for a job with
    ``secret`` (``None``: a job on loopback)."""
    _Job.secret = secret
    rendezvous_handler_registry.register(C10D, create_c10d)
    rendezvous_handler_registry.register(STATIC, create_static)
