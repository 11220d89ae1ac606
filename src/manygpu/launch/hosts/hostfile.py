"""Which hosts a job runs on and how many processes each: ``-H``, ``--hostfile``, ``-np``.

The formats people already have: Horovod's and mpirun's ``-H a:4,b:4``, host
files of ``host:4`` (Horovod) or ``host slots=4`` lines (OpenMPI, DeepSpeed),
with ``#`` comments and blank lines; and the variables other hosts get:
mpirun's ``-x KEY[=VALUE]`` and a ``.manygpu_env`` file of ``KEY=VALUE``
lines, as DeepSpeed's ``.deepspeed_env``. Pure functions of text: every
mistake is a one-line :class:`UsageError` naming the flag or file line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from manygpu.errors import UsageError
from manygpu.runtime.env import Environ

ENV_FILE = ".manygpu_env"
"""Variables for every host, one ``KEY=VALUE`` a line, read from the current directory."""

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.%@-]*|\[[0-9A-Fa-f:.%A-Za-z]+\]")
"""A host name, ``user@host``, an IPv4 address or a bracketed IPv6 one; never a
leading ``-`` (ssh would read it as an option)."""
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, kw_only=True)
class Host:
    """One host of the job, as typed."""

    name: str
    """As typed: ``node1``, ``user@node1``, ``10.0.0.2`` or ``[fe80::2]``."""
    slots: int | None = None
    """Processes to run there; ``None`` lets the host decide (--nproc-per-node, or
    its GPUs, or 2 on a CPU), as a single-node launch does."""

    @property
    def address(self) -> str:
        """The name to resolve: without ``user@`` and IPv6 brackets."""
        return self.name.rpartition("@")[2].strip("[]")


def _slots(text: str, where: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise UsageError(f"{where}: slots {text!r} must be a whole number >= 1, e.g. node1:4")
    return int(text)


def _host(name: str, where: str) -> str:
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"{where}: {name!r} is not a host name (write e.g. node1, 10.0.0.2 or [fe80::2])"
        )
    return name


def parse_host(item: str, where: str) -> Host:
    """``node1:4`` / ``node1`` / ``[fe80::2]:4`` -> a :class:`Host`."""
    text = item.strip()
    if text.startswith("[") or text.count(":") == 1:
        head, sep, slots = text.rpartition(":") if not text.endswith("]") else (text, "", "")
        if sep and head:
            return Host(name=_host(head, where), slots=_slots(slots, where))
    return Host(name=_host(text, where), slots=None)


def parse_hosts(text: str) -> tuple[Host, ...]:
    """``-H a:4,b:4`` -> the hosts in order (each listed once)."""
    items = text.split(",")
    if any(not item.strip() for item in items):
        raise UsageError(f"-H {text!r} has an empty entry; write HOST[:SLOTS],... e.g. a:4,b:4")
    return _once([parse_host(item, f"-H {item.strip()!r}") for item in items], "-H")


def parse_hostfile(text: str, source: str) -> tuple[Host, ...]:
    """A host file's lines (``host:4``, ``host slots=4 [max_slots=8]``) -> the hosts."""
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.partition("#")[0].strip()
        if line:
            hosts.append(_hostfile_line(line, f"{source} line {number}"))
    if not hosts:
        raise UsageError(f"{source} lists no host; write one HOST slots=N (or HOST:N) a line")
    return _once(hosts, source)


def _hostfile_line(line: str, where: str) -> Host:
    first, *rest = line.split()
    host = parse_host(first, where)
    for word in rest:
        key, sep, value = word.partition("=")
        if key == "slots" and sep:
            if host.slots is not None:
                raise UsageError(f"{where}: slots given twice; write HOST slots=N or HOST:N")
            host = replace(host, slots=_slots(value, where))
        elif key in ("max_slots", "max-slots") and sep:
            _slots(value, where)  # OpenMPI's oversubscription cap: checked, not needed
        else:
            raise UsageError(
                f"{where}: unknown {word!r}; write HOST slots=N (OpenMPI, DeepSpeed) or HOST:N"
            )
    return host


def _once(hosts: Sequence[Host], where: str) -> tuple[Host, ...]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise UsageError(
                f"{where} lists {host.name} twice; give each host once with all its slots"
            )
        seen.add(host.name)
    return tuple(hosts)


def allocate(hosts: Sequence[Host], np: int | None, nproc_per_node: int | None) -> tuple[Host, ...]:
    """Each host's process count: ``-np`` fills the slots in host order.

    A host without slots runs ``nproc_per_node`` (``None``: its own default).
    Fewer processes than slots leave the last hosts short or out, as mpirun does.
    """
    filled = [
        replace(h, slots=nproc_per_node) if h.slots is None and nproc_per_node else h for h in hosts
    ]
    if np is None:
        return tuple(filled)
    unknown = [h.name for h in filled if h.slots is None]
    if unknown:
        raise UsageError(
            f"-np {np} needs each host's slots but {unknown[0]} has none; "
            f"write {unknown[0]}:N or give --nproc-per-node N (a number: -np fills slots)"
        )
    total = sum(h.slots or 0 for h in filled)
    if np > total:
        listed = ",".join(f"{h.name}:{h.slots}" for h in filled)
        raise UsageError(f"-np {np} is more than the {total} slots of {listed}; lower -np")
    placed: list[Host] = []
    left = np
    for h in filled:
        take = min(h.slots or 0, left)
        if take:
            placed.append(replace(h, slots=take))
        left -= take
    return tuple(placed)


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (``export`` and matching quotes allowed, ``#`` comments)."""
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            raise UsageError(f"{source} line {number}: {line[:60]!r} is not KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def parse_exports(items: Sequence[str], env: Environ) -> dict[str, str]:
    """mpirun's ``-x KEY=VALUE`` (set) and ``-x KEY`` (this machine's value)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not _KEY.fullmatch(key):
            raise UsageError(f"-x {item!r}: write -x KEY=VALUE or -x KEY (a variable name)")
        if not sep:
            if key not in env:
                raise UsageError(f"-x {key}: {key} is not set here; give -x {key}=VALUE")
            value = env[key]
        out[key] = value
    return out
