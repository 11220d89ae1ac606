"""The job's secret: what a process must hold to join a job that meets over the network.

A multi-node job's rendezvous store has to listen where the other hosts reach
it, and so does any stranger on that network. The store itself sits behind a
:class:`~manygpu.runtime.store_gate.Gate` keyed by this secret; in the
launcher, the run id (and so every rendezvous key) is derived from it too and
it signs the rendezvous state, so a leftover launcher of another job with
another secret cannot meet this one.

Where it comes from, first found wins: the driver of ``-H`` / ``--hostfile``
draws a fresh one and hands it to every host on the ssh stdin pipe;
``--job-secret-file FILE``; ``MANYGPU_JOB_SECRET`` (read here). It is never on
a command line and never in the store, and the launcher removes it from the
environment its workers inherit. Its value never shows in a repr or a log.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass, field

from manygpu.errors import UsageError
from manygpu.runtime.env import JOB_SECRET, Environ

MIN_LENGTH = 16
"""Characters; ``openssl rand -hex 32`` gives 64."""

HOW = (
    "put the same secret on every node: export MANYGPU_JOB_SECRET=$(openssl rand -hex 32) "
    "(or --job-secret-file FILE, mode 600); -H/--hostfile draws one for you"
)


@dataclass(frozen=True)
class JobSecret:
    """A job's secret; its value never shows in a repr or a log."""

    value: bytes = field(repr=False)

    @classmethod
    def draw(cls) -> JobSecret:
        """A fresh secret (256 bits), as the driver of a launch over hosts makes one."""
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def from_text(cls, text: str, source: str) -> JobSecret:
        value = text.strip()
        if len(value) < MIN_LENGTH:
            raise UsageError(
                f"{source}: the job secret is {len(value)} characters; give at least "
                f"{MIN_LENGTH} (e.g. openssl rand -hex 32)"
            )
        return cls(value.encode())

    @property
    def text(self) -> str:
        """The value, for the one place that hands it on (the driver's stdin line)."""
        return self.value.decode()

    def derive(self, label: str) -> bytes:
        """A key for one use; separate uses never share a key."""
        return hmac.new(self.value, b"manygpu/" + label.encode(), hashlib.sha256).digest()

    def run_id(self, given: str) -> str:
        """The run id every node of the job computes alike, unguessable without the secret."""
        digest = hmac.new(self.derive("run-id"), given.encode(), hashlib.sha256)
        return "manygpu-" + digest.hexdigest()[:24]

    @property
    def gate_key(self) -> bytes:
        """The key of the store's gate handshake."""
        return self.derive("store-gate")


def load(path: str | None, env: Environ) -> JobSecret | None:
    """The secret from ``--job-secret-file`` or ``MANYGPU_JOB_SECRET``; ``None`` when neither."""
    if path is not None:
        return JobSecret.from_text(_read(path), f"--job-secret-file {path}")
    value = env.get(JOB_SECRET)
    if value:
        return JobSecret.from_text(value, JOB_SECRET)
    return None


def _read(path: str) -> str:
    try:
        info = os.stat(path)
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(
                f"--job-secret-file {path} can be read by other users; chmod 600 {path}"
            )
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"--job-secret-file {path}: cannot read it ({exc.strerror})") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address (or name) of this machine's loopback only."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def required(endpoint_host: str) -> bool:
    """Whether a job must have a secret: its store listens beyond loopback.

    A job that meets on loopback (one node, or several launchers on one
    machine) is reachable from this machine only, as a one-node job always
    is. A job whose rendezvous address is a network address can be reached
    by other hosts, and so by strangers.
    """
    return not is_loopback(endpoint_host)


def refusal(endpoint: str) -> UsageError:
    """The one line for a network job without a secret."""
    return UsageError(
        f"this job meets over the network (rendezvous {endpoint}), so its nodes must prove "
        f"they belong to it: {HOW}"
    )
