"""Cheap checks done before starting workers, so errors come in a second, not a hang."""

from __future__ import annotations

import errno
import socket

from manygpu.errors import UsageError


def split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` / ``"host"`` -> (host, port)."""
    text = endpoint.strip()
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed:
            raise UsageError(f"rendezvous endpoint {endpoint!r} lacks the closing ']'")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host:
        raise UsageError(f"rendezvous endpoint {endpoint!r} has no host; write HOST:PORT")
    if port_text and not port_text.isdigit():
        raise UsageError(f"rendezvous endpoint {endpoint!r} has a bad port; write HOST:PORT")
    port = int(port_text) if port_text else default_port
    if not 0 <= port <= 65535:
        raise UsageError(f"port {port} is outside 0..65535")
    return host, port


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (so we can bind it)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


def check_resolves(host: str) -> None:
    """Raise at once when ``host`` names no address (torch would retry for a minute)."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise UsageError(
            f"cannot resolve the rendezvous address {host!r} ({why}); give node 0's IP "
            "address or a host name every node can resolve"
        ) from None


def check_port_free(host: str, port: int) -> None:
    """Raise a clear error when ``host:port`` is taken (the store could not start)."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise UsageError(f"cannot resolve master address {host!r}: {exc.strerror}") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the store itself binds (rendezvous.listen_fd): a port left in TIME_WAIT
        # by a job that just ended is free to it; only a live listener is a clash.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"master port {port} on {host} is already in use; choose another with "
                    "--master-port, or stop the process holding it"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise UsageError(
                    f"master address {host} is not an address of this machine, but this is node 0; "
                    "give this node's own address with --master-addr"
                ) from None
            raise


def source_address(host: str) -> str | None:
    """This machine's address on the route to ``host`` (where its peers reach it).

    A connected UDP socket sends nothing; the kernel just picks the source
    address. ``None`` when ``host`` does not resolve or has no route.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            return str(sock.getsockname()[0])
    except OSError:
        return None
