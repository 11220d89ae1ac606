"""A real OpenSSH server in each emulated host, for launches over ssh.

``with EmulatedCluster(3) as cluster, SshHosts(cluster) as ssh:`` starts one
``sshd`` per host namespace (hosts 1.. by default: host 0 is where the test's
launcher runs), listening only on that host's address, in the foreground
(``-D``) so this object owns it and ends it. Its host keys, the client key,
``authorized_keys``, ``known_hosts``, ``sshd_config`` and the client's ssh
config all live in a temporary directory; nothing is written to ``~/.ssh`` or
``/etc/ssh``, and no sshd ever runs in the root namespace. Give the client
config to ssh with ``-F`` (``manygpu launch --ssh-config``): ``ssh.config``
logs in, ``ssh.wrong_config`` offers a key the hosts refuse.

Also usable from a benchmark script: put ``tests/cluster`` on ``sys.path``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import psutil

from manygpu.emulate import EmulatedCluster

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = "/run/sshd"
"""Debian's sshd refuses to start without its privilege-separation directory."""


def ensure_openssh() -> str | None:
    """``None`` when sshd and ssh are here (installing Debian's openssh-server if
    missing), else why not: the reason a test skips with.

    The package's install scripts must not start an sshd in the root namespace:
    a ``policy-rc.d`` that answers 101 ("not allowed") is in place while apt runs.
    """
    if os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen"):
        return None
    if shutil.which("apt-get") is None:
        return "sshd is not installed and there is no apt-get to install openssh-server"
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    try:
        if ours:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        res = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "openssh-server"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"installing openssh-server failed: {exc}"
    finally:
        if ours:
            policy.unlink(missing_ok=True)
    if res.returncode != 0 or not os.path.exists(SSHD):
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"apt-get install openssh-server failed: {tail[0]}"
    return None


def _keygen(path: Path) -> str:
    """A new ed25519 key pair at ``path``; the public key's text."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
        check=True,
        capture_output=True,
    )
    return path.with_suffix(".pub").read_text().strip()


class SshHosts:
    """One foreground ``sshd`` per chosen host of ``cluster``, and client configs."""

    def __init__(self, cluster: EmulatedCluster, hosts: Sequence[int] | None = None) -> None:
        self.cluster = cluster
        self.hosts = list(hosts) if hosts is not None else list(range(1, cluster.count))
        self.dir = Path(tempfile.mkdtemp(prefix="manygpu-sshd-"))
        self.config = self.dir / "ssh_config"
        """Client config (``ssh -F``) that logs in to every host as this user."""
        self.wrong_config = self.dir / "ssh_config_wrong_key"
        """Client config whose key is not in ``authorized_keys``: the login is refused."""
        self.daemons: dict[int, subprocess.Popen[str]] = {}

    def __enter__(self) -> SshHosts:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _start(self) -> None:
        os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
        client = self.dir / "client_key"
        (self.dir / "authorized_keys").write_text(_keygen(client) + "\n")
        _keygen(self.dir / "wrong_key")
        known = []
        for i in self.hosts:
            key = _keygen(self.dir / f"host{i}_key").split()
            known.append(f"{self.cluster.addresses[i]} {key[0]} {key[1]}")
            self._sshd_config(i)
        (self.dir / "known_hosts").write_text("\n".join(known) + "\n")
        self.config.write_text(self._client_config(client))
        self.wrong_config.write_text(self._client_config(self.dir / "wrong_key"))
        for i in self.hosts:
            log = open(self.dir / f"sshd{i}.log", "wb")  # noqa: SIM115  (the daemon holds it)
            self.daemons[i] = self.cluster.popen(
                i,
                [SSHD, "-D", "-e", "-f", str(self.dir / f"sshd{i}_config")],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log.close()
        for i in self.hosts:
            self._wait_listening(i)

    def _sshd_config(self, i: int) -> None:
        lines = [
            f"ListenAddress {self.cluster.addresses[i]}",
            "Port 22",
            f"HostKey {self.dir / f'host{i}_key'}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PidFile none",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the key files live in a temporary directory
            "UseDNS no",
            "PrintMotd no",
            "MaxStartups 100",
            "MaxSessions 100",
            "LogLevel ERROR",
        ]
        (self.dir / f"sshd{i}_config").write_text("\n".join(lines) + "\n")

    def _client_config(self, key: Path) -> str:
        return (
            "Host *\n"
            f"  User {psutil.Process().username()}\n"
            f"  IdentityFile {key}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.dir / 'known_hosts'}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n"
            "  LogLevel ERROR\n"
        )

    def _wait_listening(self, i: int, timeout_s: float = 10.0) -> None:
        addr = f"{self.cluster.addresses[i]}:22"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            daemon = self.daemons[i]
            if daemon.poll() is not None:
                log = (self.dir / f"sshd{i}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd on host {i} exited {daemon.returncode}: {log[-500:]}")
            res = subprocess.run(
                self.cluster.command(i, ["ss", "-Hltn", "src", addr]),
                capture_output=True,
                text=True,
            )
            if addr in res.stdout:
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd on host {i} is not listening on {addr} after {timeout_s}s")

    def processes_left(self, host: int) -> list[str]:
        """Processes in ``host`` other than its sshd listener: what a job left behind."""
        res = subprocess.run(
            ["ip", "netns", "pids", self.cluster.names[host]], capture_output=True, text=True
        )
        daemon = self.daemons.get(host)
        left = []
        for pid in (int(p) for p in res.stdout.split()):
            if daemon is not None and pid == daemon.pid:
                continue
            try:
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                left.append(f"{pid} {' '.join(proc.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                continue
        return left

    def wait_until_clean(
        self, hosts: Sequence[int], timeout_s: float = 15.0
    ) -> dict[int, list[str]]:
        """Each host's leftover processes once none is left, or at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = {i: self.processes_left(i) for i in hosts}
            if not any(left.values()) or time.monotonic() > deadline:
                return {i: procs for i, procs in left.items() if procs}
            time.sleep(0.2)

    def close(self) -> None:
        """End every sshd (and, with it, its sessions) and remove the keys."""
        for daemon in self.daemons.values():
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self.daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
