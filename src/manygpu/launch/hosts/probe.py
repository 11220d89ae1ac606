"""Preflight of a launch over hosts: what each host has, asked before anything starts.

``python -m manygpu.launch.hosts.probe [--bind HOST:PORT] [--script PATH]`` runs
on every other host over ssh and prints one JSON line: the versions that must
match (Python, torch, manygpu, as the doctor's cross-rank check demands), its
host name, whether the rendezvous port can be bound there and whether the
script exists. It imports no torch (package metadata gives its version), so
it answers in a fraction of a second. One ssh round trip per host also proves
the login works before any host starts a worker.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import sys
from collections.abc import Mapping, Sequence

MUST_MATCH = ("manygpu", "torch", "python")
"""What every host must share: ranks of different versions fail in obscure ways."""


def versions() -> dict[str, str]:
    """This interpreter's Python, torch and manygpu versions."""
    from manygpu._version import __version__

    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return {"manygpu": __version__, "torch": torch, "python": platform.python_version()}


def bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on here (``None``: it can)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return f"cannot resolve {host}: {exc}"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError as exc:
            return f"port {port} on {host}: {exc.strerror}"
    return None


def probe(bind: str | None, script: str | None) -> dict[str, object]:
    """This host's answers (see the module docstring)."""
    facts: dict[str, object] = {"versions": versions(), "hostname": socket.gethostname()}
    if bind is not None:
        host, _, port = bind.rpartition(":")
        facts["bind_error"] = bind_error(host.strip("[]"), int(port))
    if script is not None:
        facts["script_missing"] = not os.path.isfile(script)
    return facts


def mismatch(here: Mapping[str, str], host: str, there: Mapping[str, str]) -> str | None:
    """One line naming ``host`` and both versions when they differ (``None``: they match)."""
    for what in MUST_MATCH:
        if here.get(what) != there.get(what):
            return (
                f"host {host} has {what} {there.get(what)} but this machine has "
                f"{what} {here.get(what)}; install the same versions on every host "
                "(one image or lock file), or give --remote-python"
            )
    return None


def main(argv: Sequence[str]) -> int:
    """Print this host's facts as one JSON line."""
    args = dict(zip(argv[::2], argv[1::2], strict=False))
    print(json.dumps(probe(args.get("--bind"), args.get("--script"))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
