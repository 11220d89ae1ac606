"""K emulated hosts as network namespaces, for real multi-node runs on one machine.

Layout: one "switch" namespace holds a bridge; each host namespace gets a veth
pair, ``eth0`` inside the host with an address of the subnet, the peer end on
the bridge. Links can be shaped with ``tc`` on both ends (egress of the host,
and egress of the switch port towards it), so a host's send *and* receive
bandwidth are limited, as on a real NIC. Nothing touches the root namespace's
network: every address lives only inside the namespaces, and everything is
deleted on exit, on error, and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from manygpu.emulate import stale
from manygpu.errors import UsageError

DEFAULT_SUBNET = "10.213.0.0/24"
"""A private range used only inside our namespaces."""


@dataclass(frozen=True, kw_only=True)
class LinkShape:
    """How every host's link is shaped (``None`` = unshaped)."""

    rate: str | None = None
    """Bandwidth as ``tc`` writes it, e.g. ``"1gbit"``."""
    delay: str | None = None
    """One-way latency added per direction, e.g. ``"0.1ms"``."""


def netns_available() -> tuple[bool, str]:
    """(True, "") when we can create namespaces here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"the '{tool}' command (iproute2) is not installed"
    probe = f"mgprobe{uuid.uuid4().hex[:6]}"
    if _sh(["ip", "netns", "add", probe], check=False).returncode != 0:
        return False, "cannot create a network namespace (no CAP_SYS_ADMIN?)"
    _sh(["ip", "netns", "del", probe], check=False)
    return True, ""


def hosts_file(
    base: str, names: Sequence[str], addresses: Sequence[str], extra: Mapping[str, int]
) -> str:
    """The ``/etc/hosts`` each emulated host sees: ``base``, then the ``extra`` names
    (name -> host index), then every host by its namespace's name.

    The first name of an address is what a reverse lookup answers, so the names a
    cluster gives its hosts (``node1``, a pod's DNS name) come before the
    namespaces' own: a verdict names a lost peer as the cluster does.
    """
    pairs = [*((addresses[i], n) for n, i in extra.items()), *zip(addresses, names, strict=True)]
    lines = [*base.splitlines(), *(f"{a} {n}" for a, n in pairs)]
    # A dual-stack listener (the TCPStore's) sees IPv4 peers as ::ffff:a.b.c.d, which the
    # resolver looks up as that IPv6 address: name those too.
    lines += [f"::ffff:{a} {n}" for a, n in pairs]
    return "\n".join(lines) + "\n"


def _sh(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")
    return res


class EmulatedCluster:
    """``with EmulatedCluster(4, LinkShape(rate="1gbit")) as c: c.run(0, [...])``.

    Args:
        hosts: number of emulated hosts (2..250).
        shape: link shaping for every host.
        subnet: IPv4 subnet for the hosts' addresses (host i gets the (i+1)-th).
    """

    def __init__(self, hosts: int, shape: LinkShape | None = None, subnet: str = DEFAULT_SUBNET):
        if not 1 <= hosts <= 250:
            raise UsageError(f"hosts must be within 1..250, got {hosts}")
        self.count = hosts
        self.shape = shape or LinkShape()
        self.network = ipaddress.ip_network(subnet)
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"mgsw{self.tag}"
        self.names = [f"mgh{self.tag}-{i}" for i in range(hosts)]
        self.addresses = [str(self.network.network_address + i + 1) for i in range(hosts)]
        self._created: list[str] = []
        self._etc: list[Path] = []  # /etc/netns/<host>: files `ip netns exec` mounts over /etc

    # -- life cycle -------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self._old_handlers = {}
        if threading.current_thread() is threading.main_thread():  # signals: main thread only
            self._old_handlers = {
                sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
            }
        stale.clean_stale()  # namespaces of an earlier run that was SIGKILLed
        stale.claim(self.tag, [self.switch, *self.names])
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Turn the signal into an exception so ``with`` blocks unwind and tear down.
        raise KeyboardInterrupt(f"signal {signum}")

    def teardown(self) -> None:
        """Delete every namespace we made (their veths go with them)."""
        for name in reversed(self._created):
            _sh(["ip", "netns", "del", name], check=False)
        self._created.clear()
        for where in self._etc:
            shutil.rmtree(where, ignore_errors=True)
        self._etc.clear()
        stale.release(self.tag)
        for sig, handler in getattr(self, "_old_handlers", {}).items():
            signal.signal(sig, handler)
        self._old_handlers = {}

    def _create(self) -> None:
        self._add_ns(self.switch)
        self._in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._in(self.switch, "ip", "link", "set", "br0", "up")
        prefix = self.network.prefixlen
        for i, (name, addr) in enumerate(zip(self.names, self.addresses, strict=True)):
            self._add_ns(name)
            port = f"p{i}"
            # Create the pair inside the switch namespace, then move one end:
            # no interface ever appears in the root namespace.
            self._in(self.switch, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0")
            self._in(self.switch, "ip", "link", "set", "eth0", "netns", name)
            self._in(self.switch, "ip", "link", "set", port, "master", "br0")
            self._in(self.switch, "ip", "link", "set", port, "up")
            self._in(name, "ip", "addr", "add", f"{addr}/{prefix}", "dev", "eth0")
            self._in(name, "ip", "link", "set", "eth0", "up")
            self._in(name, "ip", "link", "set", "lo", "up")
            self._shape(name, "eth0", self.shape)
            self._shape(self.switch, port, self.shape)
        # Every address gets a name, both ways: a reverse lookup of a peer (the TCPStore
        # does one per connection) otherwise asks a DNS server these namespaces cannot
        # reach, waits for it and warns "hostname of the client socket cannot be retrieved".
        root = Path("/etc/hosts")
        self._write_hosts(root.read_text() if root.is_file() else "", {})

    def _add_ns(self, name: str) -> None:
        _sh(["ip", "netns", "add", name])
        self._created.append(name)
        self._in(name, "ip", "link", "set", "lo", "up")

    def name_hosts(self, names: Mapping[str, int]) -> None:
        """Make ``names`` resolve to hosts' addresses inside every host, as a cluster's DNS
        would (a Kubernetes headless service's pod names): ``{"pod-0.svc": 0, ...}``.

        Replaces this machine's own entries: only localhost, the hosts and ``names`` resolve.
        """
        self._write_hosts("127.0.0.1 localhost\n", names)

    def _write_hosts(self, base: str, extra: Mapping[str, int]) -> None:
        """``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``."""
        text = hosts_file(base, self.names, self.addresses, extra)
        for ns in self.names:
            where = Path("/etc/netns") / ns
            where.mkdir(parents=True, exist_ok=True)
            if where not in self._etc:
                self._etc.append(where)
            (where / "hosts").write_text(text)

    def reshape(self, host: int, shape: LinkShape) -> None:
        """Shape host ``host``'s link alone, both ways (a slow NIC or a congested port)."""
        self._shape(self.names[host], "eth0", shape)
        self._shape(self.switch, f"p{host}", shape)

    def _shape(self, ns: str, dev: str, shape: LinkShape) -> None:
        rate, delay = shape.rate, shape.delay
        if rate is None and delay is None:
            _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
        if delay is not None:
            cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay", delay]
            if rate is not None:
                cmd += ["rate", rate]
            res = _sh(["ip", "netns", "exec", ns, *cmd, "limit", "100000"], check=False)
            if res.returncode != 0:
                raise UsageError(
                    f"cannot add {delay} of latency: {res.stderr.strip()} (this kernel lacks "
                    "sch_netem); shape bandwidth only, with LinkShape(rate=...)"
                )
        elif rate is not None:
            # Token bucket: the burst must cover a timer tick at this rate, and the
            # queue (latency) must hold a bulk transfer's window, or TCP stalls.
            self._in(
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "512kb",
                "latency",
                "100ms",
            )

    def _in(self, ns: str, *cmd: str) -> None:
        _sh(["ip", "netns", "exec", ns, *cmd])

    # -- running things ---------------------------------------------------------
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside host ``host``."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``host`` (text mode; pass stdout/stderr as needed)."""
        return subprocess.Popen(self.command(host, argv), text=True, **kwargs)  # type: ignore[call-overload]

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process in host ``host`` (a machine that crashes); returns pids."""
        res = _sh(["ip", "netns", "pids", self.names[host]], check=False)
        pids = [int(p) for p in res.stdout.split()]
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def run_all(
        self, argv_for: Sequence[Sequence[str]], timeout: float, env: dict[str, str] | None = None
    ) -> list[subprocess.CompletedProcess[str]]:
        """Run one command per host at once; kill them all at ``timeout``."""
        procs = [
            self.popen(
                i,
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
            for i, argv in enumerate(argv_for)
        ]
        results = []
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=timeout)
                results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        return results
