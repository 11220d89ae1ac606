"""Which network interface gloo and NCCL would use: pure rules over interface facts.

Both libraries pick an interface by themselves, and a wrong pick (loopback, a
docker bridge, an interface the other nodes cannot reach) shows up as a hang
at the first collective. These functions restate their rules so the doctor
can say in advance which interface each one would take and why.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from manygpu.doctor.facts import InterfaceFacts

NCCL_DEFAULT_EXCLUDE = "^docker,lo,virbr"
"""What NCCL skips when no ``ib*`` interface is there and no variable is set."""


def interface_of(address: str, interfaces: Sequence[InterfaceFacts]) -> InterfaceFacts | None:
    """The interface that holds ``address``; loopback addresses map to ``lo``."""
    for itf in interfaces:
        if address in itf.addresses:
            return itf
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        return None
    if loopback:
        # 127.0.1.1 (Debian's hostname address) lives on lo without being listed.
        return next((itf for itf in interfaces if itf.is_loopback), None)
    return None


def nccl_match(spec: str, names: Sequence[str]) -> list[str]:
    """Names selected by an ``NCCL_SOCKET_IFNAME``-style list.

    ``eth`` matches every name starting with ``eth``; ``=eth0`` only ``eth0``;
    a leading ``^`` turns the list into exclusions (``^docker,lo``).
    """
    text = spec.strip()
    exclude = text.startswith("^")
    text = text.removeprefix("^")
    exact = text.startswith("=")
    text = text.removeprefix("=")
    parts = [p.strip() for p in text.split(",") if p.strip()]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in parts)

    return [n for n in names if hit(n) != exclude]


def pick_gloo(
    env_ifname: str | None,
    hostname_addresses: Sequence[str],
    interfaces: Sequence[InterfaceFacts],
) -> tuple[str | None, str | None, str]:
    """(interface, address, reason) gloo would use, as ``ProcessGroupGloo`` decides.

    ``GLOO_SOCKET_IFNAME`` wins (its first entry); otherwise gloo binds the
    address this host's name resolves to, and falls back to loopback when the
    name does not resolve to a local address.
    """
    if env_ifname:
        first = env_ifname.split(",")[0].strip()
        itf = next((i for i in interfaces if i.name == first), None)
        address = _first_ipv4(itf.addresses) if itf else None
        return first, address, f"GLOO_SOCKET_IFNAME={env_ifname}"
    for address in hostname_addresses:
        itf = interface_of(address, interfaces)
        if itf is not None:
            return itf.name, address, f"the hostname resolves to {address}"
    lo = next((i for i in interfaces if i.is_loopback), None)
    why = (
        "the hostname does not resolve to an address of this machine; loopback fallback"
        if hostname_addresses
        else "the hostname does not resolve; loopback fallback"
    )
    return (lo.name if lo else "lo"), "127.0.0.1", why


def pick_nccl(
    env_ifname: str | None, interfaces: Sequence[InterfaceFacts]
) -> tuple[list[str], str]:
    """(interfaces, reason) NCCL's socket transport would use (bootstrap and TCP).

    ``NCCL_SOCKET_IFNAME`` wins; otherwise ``ib*`` interfaces, then anything
    but docker / loopback / libvirt bridges, then loopback.
    """
    usable = [i.name for i in interfaces if i.is_up and i.addresses]
    if env_ifname:
        return nccl_match(env_ifname, usable), f"NCCL_SOCKET_IFNAME={env_ifname}"
    ib = nccl_match("ib", usable)
    if ib:
        return ib, "NCCL prefers ib* interfaces"
    other = nccl_match(NCCL_DEFAULT_EXCLUDE, usable)
    if other:
        return other, "no ib* interface; NCCL skips docker*, lo and virbr*"
    lo = [i.name for i in interfaces if i.is_loopback]
    return lo, "only loopback is up"


def _first_ipv4(addresses: Sequence[str]) -> str | None:
    for address in addresses:
        try:
            if ipaddress.ip_address(address).version == 4:
                return address
        except ValueError:
            continue
    return addresses[0] if addresses else None
