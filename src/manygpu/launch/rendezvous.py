"""Rendezvous for ``manygpu launch``: JSON state, stores that listen on one address.

torch's own handlers ("c10d", "static") create their ``TCPStore`` servers on
every address of the machine, and the c10d one unpickles the shared state.
Ours are the same handlers with two changes: every store server listens only
on the address the job meets on (loopback for one node, the interface asked
for with several) and the c10d state is JSON (:mod:`manygpu.launch.rdzv_state`).
They are registered under their own names so torch's stay untouched.
"""

from __future__ import annotations

import errno
import re
import secrets
import socket
from datetime import timedelta
from typing import Any, cast

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
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

RUN_ID_KEY = "manygpu.run_id"
_RUN_ID = re.compile(r"manygpu-[0-9a-f]{16}")
C10D = "manygpu-c10d"
STATIC = "manygpu-static"
BACKENDS = {"c10d": C10D, "static": STATIC}
"""The user's ``--rdzv-backend`` name → the handler we register for it."""


def listen_fd(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only; the caller's store owns the fd."""
    errors: list[OSError] = []
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr[:2] if family == socket.AF_INET else addr)
            sock.listen(socket.SOMAXCONN)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        return sock.detach()
    raise errors[0] if errors else OSError(errno.EADDRNOTAVAIL, f"no address for {host}")


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


def agree_run_id(store: Store, run_id: str, hosting: bool) -> str:
    """``run_id``, or for :data:`AGREED_ID` the random id the store's host drew.

    Nodes started one by one share no secret, so the host draws the id and
    the others read it from the store: every job gets a fresh, unguessable
    id without any flag (a leftover agent of another job cannot join it).
    """
    if run_id != AGREED_ID:
        return run_id
    if hosting:
        store.compare_set(RUN_ID_KEY, "", f"manygpu-{secrets.token_hex(8)}")
    value = store.get(RUN_ID_KEY).decode("utf-8", "replace")
    if not _RUN_ID.fullmatch(value):
        raise rdzv_state.foreign_write("the run id in the rendezvous store", repr(value[:40]))
    return value


class JsonStateBackend(RendezvousBackend):
    """torch's C10dRendezvousBackend with the state kept as checked JSON."""

    _NULL = "null"  # set first, so a plain ``get`` never blocks

    def __init__(self, store: Store, run_id: str, where: str) -> None:
        self._store = store
        self._key = f"manygpu.rendezvous.{run_id}"
        self._where = f"{where} (key {self._key})"
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
        text = rdzv_state.encode(rdzv_state.from_local_pickle(state))
        expected = token.decode() if token is not None else self._NULL
        raw = self._call("compare_set", self._key, expected, text)
        pair = self._decode(raw)
        if pair is None:
            return None
        return pair[0], pair[1], raw == text.encode()

    def _decode(self, raw: bytes) -> tuple[bytes, Token] | None:
        if raw == self._NULL.encode():
            return None
        return rdzv_state.to_local_pickle(rdzv_state.decode(raw, self._where)), raw

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(
                f"lost the rendezvous store at {self._where}: {exc}"
            ) from exc


class _DynamicHandler(DynamicRendezvousHandler):
    """The workers' bootstrap store listens on this node's address only."""

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        return serve_store(master_addr, master_port, timedelta(seconds=300), multi_tenant=True)


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
            store = serve_store(host, port, timeout, multi_tenant=True)
            return store, f"{host}:{store.port}", True
        except OSError as exc:
            if configured or exc.errno != errno.EADDRINUSE:
                raise RendezvousConnectionError(
                    f"cannot host the rendezvous store on {host}:{port}: {exc.strerror}"
                ) from None
    try:
        client = TCPStore(host, port, is_master=False, timeout=timeout)
        return client, f"{host}:{port}", False
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
    run_id = agree_run_id(store, params.run_id, hosting)
    return _DynamicHandler.from_backend(
        run_id,
        store,
        JsonStateBackend(store, run_id, where),
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        _timeouts(params),
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3,
    )


class _StaticHandler(StaticTCPRendezvous):
    """torch's static rendezvous; node 0's store listens on the master address only."""

    def get_backend(self) -> str:
        return STATIC

    def next_rendezvous(self) -> RendezvousInfo:
        if not self._store:
            if self.rank == 0:
                self._store = serve_store(
                    self.master_addr,
                    self.master_port,
                    self.timeout,
                    world_size=self.world_size,
                    multi_tenant=True,
                )
            else:
                self._store = TCPStore(
                    self.master_addr,
                    self.master_port,
                    self.world_size,
                    False,
                    self.timeout,
                    multi_tenant=True,
                )
            self.run_id = agree_run_id(self._store, self.run_id, hosting=self.rank == 0)
        return super().next_rendezvous()


def create_static(params: RendezvousParameters) -> RendezvousHandler:
    """The static handler for ``params`` (fixed node count, node 0 hosts)."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    plain = cast(StaticTCPRendezvous, create_rdzv_handler(params))  # torch's checks
    seconds = int(plain.timeout.total_seconds())
    return _StaticHandler(
        plain.master_addr, plain.master_port, plain.rank, plain.world_size, plain.run_id, seconds
    )


def register() -> None:
    """Make our handlers known to torch's registry (idempotent)."""
    rendezvous_handler_registry.register(C10D, create_c10d)
    rendezvous_handler_registry.register(STATIC, create_static)
