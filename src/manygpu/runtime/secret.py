"""The job's secret: what a process must hold to reach a job's stores over the network.

Read here (``MANYGPU_JOB_SECRET``, or a file given to the launcher) and used
to key the gate in front of a job's store (:mod:`manygpu.runtime.store_gate`)
and, in the launcher, to derive the run id and sign the rendezvous state.
Its value never shows in a repr, a log or a command line.
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
