"""A real Slurm cluster on emulated hosts: slurmctld, one slurmd per host, munge.

``with EmulatedCluster(2) as cluster, SlurmHosts(cluster) as slurm:`` starts
one ``munged`` (its socket is a path in a temporary directory, reachable from
every host's namespace), ``slurmctld`` on host 0 and one ``slurmd`` per host,
each in the foreground (``-D``) so this object owns it and ends it, and waits
until every node is idle. ``slurm.run(["sbatch", ...])`` runs a client command
on host 0. The munge key, ``slurm.conf``, spool and state directories and the
daemons' logs all live in the temporary directory, which every command finds
through ``SLURM_CONF``; nothing is written to ``/etc/slurm`` or ``/etc/munge``,
and no daemon ever runs in the root namespace.

Each daemon (and client command) runs in its host's network namespace and in a
UTS namespace of its own whose host name is the node's (``node0``, ...), as on
real machines: ``hostname`` in a task names its node, and the node names
resolve to the hosts' addresses through the namespaces' ``/etc/hosts``.
cgroups are not used (``proctrack/linuxproc``, ``task/none``): this works in a
VM or container without a delegated cgroup tree. Jobs run as the user running
the tests (root: ``SlurmUser=root``).

Also usable from a benchmark script: put ``tests/cluster`` on ``sys.path``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import TracebackType

import psutil

from manygpu.emulate import EmulatedCluster

SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
MUNGED = "/usr/sbin/munged"
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel", "mungekey")
PACKAGES = ("slurm-wlm", "munge")


def ensure_slurm() -> str | None:
    """``None`` when Slurm's daemons, its clients and munge are here (installing
    Debian's slurm-wlm and munge if missing), else why not: the reason a test
    skips with.

    The packages' install scripts must not start munged, slurmctld or slurmd in
    the root namespace: a ``policy-rc.d`` that answers 101 ("not allowed") is in
    place while apt runs.
    """

    def present() -> bool:
        daemons = all(os.path.exists(p) for p in (SLURMCTLD, SLURMD, MUNGED))
        return daemons and all(shutil.which(c) for c in CLIENTS)

    if present():
        return None
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install slurm-wlm"
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    try:
        if ours:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        res = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
        if res.returncode != 0:  # stale package lists: refresh once, then try again
            subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=300)
            res = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"installing {' '.join(PACKAGES)} failed: {exc}"
    finally:
        if ours:
            policy.unlink(missing_ok=True)
    if res.returncode != 0 or not present():
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"apt-get install {' '.join(PACKAGES)} failed: {tail[0]}"
    return None


class SlurmHosts:
    """A Slurm cluster whose nodes are ``cluster``'s hosts; the controller is on host 0.

    Args:
        cluster: the emulated hosts (every one becomes a node).
        cpus: CPUs each node offers (tasks are not bound to them: ``task/none``).
        names: the nodes' names, ``node0``, ``node1``, ... unless given.
    """

    def __init__(
        self, cluster: EmulatedCluster, cpus: int = 2, names: Sequence[str] | None = None
    ) -> None:
        self.cluster = cluster
        self.cpus = cpus
        self.names = (
            list(names) if names is not None else [f"node{i}" for i in range(cluster.count)]
        )
        if len(self.names) != cluster.count:
            raise ValueError(f"{len(self.names)} names for {cluster.count} hosts")
        self.dir = Path(tempfile.mkdtemp(prefix="manygpu-slurm-"))
        self.dir.chmod(0o755)  # munged: every directory above its socket must be searchable
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge" / "munge.socket"
        self.env = {"SLURM_CONF": str(self.conf)}
        """What every Slurm command needs in its environment (beside the usual)."""
        self.daemons: dict[str, subprocess.Popen[str]] = {}
        """Every daemon started, by a name that is also its log's (``slurmd-node1``)."""

    def __enter__(self) -> SlurmHosts:
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

    # -- starting -----------------------------------------------------------------
    def _start(self) -> None:
        self.cluster.name_hosts({name: i for i, name in enumerate(self.names)})
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir()
        for name in self.names:
            (self.dir / "spool" / name).mkdir()
        self._start_munge()
        self.conf.write_text(self._slurm_conf())
        # slurmd loads a cgroup plugin whatever the other plugins are; `ip netns exec`
        # mounts a fresh /sys, with nothing under /sys/fs/cgroup, where autodetection
        # fails. Name the version: the plugin then loads, and nothing uses it.
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        self._daemon("slurmctld", 0, [SLURMCTLD, "-D", "-c", "-f", str(self.conf)])
        for i, name in enumerate(self.names):
            self._daemon(f"slurmd-{name}", i, [SLURMD, "-D", "-N", name, "-f", str(self.conf)])
        self.wait_idle()

    def _start_munge(self) -> None:
        where = self.socket.parent
        where.mkdir(mode=0o755)
        key = where / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        key.chmod(0o600)
        argv = [
            MUNGED,
            "-F",
            f"--socket={self.socket}",
            f"--key-file={key}",
            f"--pid-file={where / 'munged.pid'}",
            f"--seed-file={where / 'munged.seed'}",
            f"--log-file={self.dir / 'log' / 'munged.log'}",
            "--num-threads=4",
        ]
        self._daemon("munged", 0, argv)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if self.daemons["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs(['munged'])}")
            time.sleep(0.05)

    def _slurm_conf(self) -> str:
        d = self.dir
        lines = [
            "ClusterName=manygpu",
            f"SlurmctldHost={self.names[0]}({self.cluster.addresses[0]})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'spool' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups here: processes are tracked by their parents, tasks not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "ReturnToService=2",
            # Short timeouts: a test's job should never wait on a default minute.
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            "InactiveLimit=0",
            "KillWait=5",
            # sbatch --wait polls every 2 s while 2 < MinJobAge/2, then every 8, 32 s:
            # 5 s keeps it at 2 s (and a finished job's record lives on for 5 s).
            "MinJobAge=5",
            "Waittime=0",
            *(
                f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} State=UNKNOWN"
                for name, addr in zip(self.names, self.cluster.addresses, strict=True)
            ),
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        return "\n".join(lines) + "\n"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on node ``host``: its network namespace, and a UTS
        namespace whose host name is the node's (as ``hostname`` says on a real node)."""
        set_name = 'hostname "$0" && exec "$@"'
        return self.cluster.command(
            host, ["unshare", "--uts", "--", "sh", "-c", set_name, self.names[host], *argv]
        )

    def _daemon(self, name: str, host: int, argv: Sequence[str]) -> None:
        out = open(self.dir / "log" / f"{name}.out", "wb")  # noqa: SIM115  (the daemon holds it)
        try:
            self.daemons[name] = subprocess.Popen(
                self.command(host, argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(None),
                start_new_session=True,
                text=True,
            )
        finally:
            out.close()

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        base = dict(os.environ) if env is None else dict(env)
        return base | self.env

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        states: list[str] = []
        while time.monotonic() < deadline:
            for name, daemon in self.daemons.items():
                if daemon.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited {daemon.returncode} while the cluster started:\n"
                        + self.logs()
                    )
            res = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15, check=False)
            states = res.stdout.split()
            idle = {n for n, s in zip(states[::2], states[1::2], strict=False) if s == "idle"}
            if idle >= set(self.names):
                return
            time.sleep(0.3)
        raise RuntimeError(
            f"Slurm nodes not idle after {timeout_s}s (sinfo: {' '.join(states) or 'nothing'}):\n"
            + self.logs()
        )

    # -- using it -------------------------------------------------------------------
    def run(
        self,
        argv: Sequence[str],
        host: int = 0,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (sbatch, srun, squeue, scontrol...) on node ``host``
        with ``env`` (this process's environment unless given) and ``SLURM_CONF``.

        ``check``: raise (with the command's output and the daemons' logs) when it
        fails. At ``timeout`` the command and everything it started are killed.
        """
        proc = subprocess.Popen(
            self.command(host, argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=self._env(env),
            start_new_session=True,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            raise RuntimeError(
                f"{' '.join(argv)} still running after {timeout}s\nstdout: {out[-2000:]}\n"
                f"stderr: {err[-2000:]}\n{self.logs()}"
            ) from None
        res = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and res.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {res.returncode}\nstdout: {out[-2000:]}\n"
                f"stderr: {err[-2000:]}\n{self.logs()}"
            )
        return res

    def logs(self, names: Sequence[str] | None = None, tail: int = 3000) -> str:
        """The end of each daemon's log (its log file, and what it printed)."""
        parts = []
        for name in names if names is not None else list(self.daemons):
            for path in (self.dir / "log" / f"{name}.log", self.dir / "log" / f"{name}.out"):
                if path.exists():
                    text = path.read_text(errors="replace")[-tail:]
                    parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    def processes_left(self) -> list[str]:
        """Processes in the hosts that are neither a daemon of this cluster nor one of its
        helpers (slurmctld's slurmscriptd): a job's leftovers. (slurmd starts each
        slurmstepd through a double fork: a step is not counted as slurmd's.)"""
        ours = set()
        for daemon in self.daemons.values():
            with suppress(psutil.NoSuchProcess):
                proc = psutil.Process(daemon.pid)
                ours |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
        left = []
        for pid in _namespace_pids(self.cluster):
            if pid in ours:
                continue
            with suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(proc.cmdline())[:120]}")
        return left

    def kill_job_processes(self, host: int) -> list[int]:
        """SIGKILL every process of a job on node ``host`` (its ``manygpu`` launcher and
        ranks), as a crash or the OOM killer would; Slurm's daemons live on."""
        res = subprocess.run(
            ["ip", "netns", "pids", self.cluster.names[host]], capture_output=True, text=True
        )
        killed = []
        for pid in (int(p) for p in res.stdout.split()):
            with suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                argv = proc.cmdline()
                # "manygpu" alone would also match the daemons (their files' paths).
                if any(a == "manygpu" or a.startswith("manygpu.") for a in argv):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        return killed

    def wait_until_clean(self, timeout_s: float = 15.0) -> list[str]:
        """:meth:`processes_left` once none is left (a job's steps take a moment to
        end after srun returns), or at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := self.processes_left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    # -- ending ---------------------------------------------------------------------
    def close(self) -> None:
        """Cancel every job, end every daemon (slurmds, then slurmctld, then munged) and
        whatever a job left in the hosts, and remove the directory."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            with suppress(Exception):
                self.run(["scancel", "--full", "--user", psutil.Process().username()], timeout=10)
        order = sorted(self.daemons, key=lambda n: (n == "munged", n == "slurmctld"))
        for name in order:
            daemon = self.daemons[name]
            if daemon.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGTERM)
                try:
                    daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _kill_group(daemon)
            with suppress(ProcessLookupError):  # what it started in its group (slurmstepd...)
                os.killpg(daemon.pid, signal.SIGKILL)
        # slurmstepd leaves slurmd's process group (and its tasks with it): anything
        # still in a host's namespace now was started by Slurm for a job.
        for pid in _namespace_pids(self.cluster):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _namespace_pids(cluster: EmulatedCluster) -> list[int]:
    pids: list[int] = []
    for ns in cluster.names:
        res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids.extend(int(p) for p in res.stdout.split())
    return pids
