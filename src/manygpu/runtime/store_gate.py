"""A door in front of a job's TCPStore that only holders of the job's secret pass.

torch's ``TCPStore`` has no authentication: anyone who reaches its port can
list every key (``list_keys``), read them, and write or delete them, including
the addresses gloo / NCCL peers exchange and the rendezvous state that admits
nodes. So a store that must be reachable from other hosts never listens there
itself. It listens on loopback, and a :class:`Gate` listens on the job's
address: a connection is relayed to the store only after a challenge-response
on the job's key (HMAC-SHA256 over fresh nonces from both sides, so neither a
stranger nor a replay passes, and the client also knows it reached the job's
store and not an impostor). On every other node a :class:`Door` listens on
loopback and makes the same handshake on behalf of the local store clients
(the agent, its workers), which then speak plain TCPStore through it.

Nothing is encrypted: the handshake keeps strangers out of the store; someone
who can read the wire can still read what passes (see docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress

MAGIC = b"manygpu-gate/1\n"
NONCE = 32
DIGEST = 32
HANDSHAKE_S = 10.0
"""How long a peer has to finish the handshake (a stranger holding a
connection open ties up one thread for this long, no more)."""
_CHUNK = 1 << 16


def _mac(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends; then end ``dst``'s direction."""
    try:
        while chunk := src.recv(_CHUNK):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Both directions until both end, then close both.

    Without ``TCP_NODELAY`` a store request's tail waits for the previous
    segment's ACK, which the peer delays (40 ms on Linux): every relayed store
    round trip took ~45 ms instead of a fraction of one, as TCPStore's own
    sockets (which set it) do.
    """
    for sock in (a, b):
        with suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(b, a), daemon=True, name="manygpu-gate-relay")
    back.start()
    _pump(a, b)
    back.join()
    a.close()
    b.close()


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only (port 0: a free one)."""
    errors: list[OSError] = []
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        return sock
    raise errors[0] if errors else OSError(f"no address for {host}")


class _Listener:
    """Accepts on a socket and hands each connection to ``serve`` in a thread."""

    def __init__(self, sock: socket.socket, serve: Callable[[socket.socket, str], None]) -> None:
        self._sock = sock
        self._serve = serve
        self.host, self.port = sock.getsockname()[:2]
        thread = threading.Thread(target=self._accept, daemon=True, name="manygpu-gate")
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            peer = f"{addr[0]}:{addr[1]}"
            threading.Thread(
                target=self._serve, args=(conn, peer), daemon=True, name="manygpu-gate-conn"
            ).start()

    def close(self) -> None:
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class Gate(_Listener):
    """Listens on ``sock`` (bound to the job's address by :func:`listen`) and
    relays proven peers to the store on ``127.0.0.1:store_port``.

    A peer that fails the handshake is closed and named once per address on
    stderr (``on_refused``), so a stranger knocking shows in the launcher's log
    without flooding it.
    """

    def __init__(
        self,
        key: bytes,
        sock: socket.socket,
        store_port: int,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self._key = key
        self._store_port = store_port
        self._on_refused = on_refused or _say
        self._named: set[str] = set()
        super().__init__(sock, self._serve_peer)

    def _serve_peer(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.settimeout(HANDSHAKE_S)
            ours = os.urandom(NONCE)
            conn.sendall(MAGIC + ours)
            head = _read_exact(conn, len(MAGIC) + NONCE + DIGEST)
            theirs, proof = head[len(MAGIC) : -DIGEST], head[-DIGEST:]
            good = head.startswith(MAGIC) and hmac.compare_digest(
                proof, _mac(self._key, b"client", ours, theirs)
            )
            if not good:
                raise PermissionError("it does not hold the job's secret")
            conn.sendall(_mac(self._key, b"server", theirs, ours))
            conn.settimeout(None)
            store = socket.create_connection(("127.0.0.1", self._store_port), timeout=30)
            store.settimeout(None)
        except (OSError, PermissionError) as exc:
            self._refused(peer, exc)  # named before the peer sees the close
            conn.close()
            return
        _relay(conn, store)

    def _refused(self, peer: str, exc: BaseException) -> None:
        address = peer.rsplit(":", 1)[0]
        if address in self._named:
            return
        self._named.add(address)
        why = exc if isinstance(exc, PermissionError) else f"no handshake ({exc})"
        self._on_refused(f"refused a connection to the job's store from {peer}: {why}")


def _say(line: str) -> None:
    print(f"manygpu: {line}", file=sys.stderr, flush=True)


class DoorRefused(ConnectionError):
    """The store behind ``host:port`` did not accept this node's key."""


class Door(_Listener):
    """Listens on loopback; each local connection is relayed to the job's
    :class:`Gate` at ``host:port`` after proving the key.

    The gate may not be up yet (nodes start in any order): connecting is
    retried for ``timeout_s``, while the local client waits on its connection.
    """

    def __init__(
        self,
        key: bytes,
        host: str,
        port: int,
        timeout_s: float,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._key = key
        self._target = (host, port)
        self._timeout_s = timeout_s
        self._on_error = on_error or _say
        self._warned = False
        super().__init__(listen("127.0.0.1", 0), self._serve_local)

    def check(self) -> None:
        """Prove the key once now: a refusal is an error at once, not a client's
        connection reset, which a TCPStore client would retry until its timeout."""
        self._connect().close()

    def _serve_local(self, local: socket.socket, peer: str) -> None:
        try:
            remote = self._connect()
        except (OSError, DoorRefused) as exc:
            local.close()
            if not self._warned:
                self._warned = True
                self._on_error(str(exc))
            return
        _relay(local, remote)

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                return self._handshake()
            except DoorRefused:
                raise
            except OSError as exc:
                if time.monotonic() > deadline:
                    host, port = self._target
                    raise ConnectionError(
                        f"cannot reach the job's store at {host}:{port}: {exc}"
                    ) from None
                time.sleep(0.2)

    def _handshake(self) -> socket.socket:
        host, port = self._target
        remote = socket.create_connection(self._target, timeout=HANDSHAKE_S)
        try:
            head = _read_exact(remote, len(MAGIC) + NONCE)
            if not head.startswith(MAGIC):
                raise DoorRefused(f"{host}:{port} is not a manygpu job's store")
            theirs, ours = head[len(MAGIC) :], os.urandom(NONCE)
            remote.sendall(MAGIC + ours + _mac(self._key, b"client", theirs, ours))
            try:
                proof = _read_exact(remote, DIGEST)
            except ConnectionError:
                raise DoorRefused(
                    f"the job's store at {host}:{port} refused this node's job secret "
                    "(every node needs the same one)"
                ) from None
            if not hmac.compare_digest(proof, _mac(self._key, b"server", ours, theirs)):
                raise DoorRefused(f"{host}:{port} does not hold the job's secret (an impostor?)")
        except BaseException:
            remote.close()
            raise
        remote.settimeout(None)
        return remote


def open_door(key: bytes, host: str, port: int, timeout_s: float) -> Door:
    """A checked :class:`Door` to the gate at ``host:port``: a refused key or an
    unreachable gate raises here (``DoorRefused`` / ``ConnectionError``), once.

    Its accepting thread keeps it alive as long as the process.
    """
    door = Door(key, host, port, timeout_s)
    door.check()
    return door
