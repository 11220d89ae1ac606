"""Run a launch over several hosts from one machine: preflight, stream, stop, report.

The driver asks every other host first, over ssh and in parallel, what it
has (:mod:`manygpu.launch.hosts.probe`): a host that cannot be reached or
logged into, a version that differs, a taken rendezvous port or a missing
script is named in one line before anything starts. Then it starts each
host's ``manygpu launch --driven`` (:mod:`manygpu.launch.hosts.plan`), streams
every line with a ``host/rank`` prefix, and when one host fails (or Ctrl-C
comes) it closes every host's stdin: each launcher stops its workers as on
SIGTERM (:mod:`manygpu.launch.driven`). The report puts the job's first
failure first, over all hosts, and its exit code is the job's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

from manygpu.errors import UsageError
from manygpu.launch import blame, driven
from manygpu.launch.entry import script_problem
from manygpu.launch.hosts import hostfile as hosts
from manygpu.launch.hosts import plan as hostplan
from manygpu.launch.hosts import probe as hostprobe
from manygpu.launch.hosts.plan import HostPlan, NodeCommand
from manygpu.launch.netcheck import is_local_address, source_address
from manygpu.launch.spec import HostOptions, LaunchRequest
from manygpu.runtime import env as envmod
from manygpu.runtime.env import Environ
from manygpu.runtime.secret import JobSecret

SSH_FAILED = 255
"""ssh's own exit code for a connection or login failure; ours for an unreachable host."""
PROBE_SLACK_S = 60.0
"""How long a host may take, once logged in, to start Python for the preflight."""
KILL_AFTER_S = 15.0
"""After --term-timeout, how long stopped hosts get before their ssh is ended."""
SETTLE_S = 10.0
"""Once a host has failed, how long the others get to end and report on their own.

The host whose rank failed first may notice it after a host whose ranks only
lost that peer (both agents poll their workers); stopping it at once would
lose the cause, and the job would blame a consequence."""
_RANK_LINE = re.compile(r"\[rank(\d+)\]:(.*)", re.DOTALL)


class _Stop(Exception):
    """A signal asked the driver to stop the job (SIGINT, SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


# -- gathering what the plan needs ------------------------------------------------------


def read_hosts(opts: HostOptions) -> tuple[hosts.Host, ...]:
    """The hosts of ``-H`` or of ``--hostfile``."""
    if opts.hosts is not None:
        return hosts.parse_hosts(opts.hosts)
    assert opts.hostfile is not None
    return hosts.parse_hostfile(_read(opts.hostfile, "--hostfile"), opts.hostfile)


def _read(path: str, what: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot read it ({exc.strerror})") from None


def job_variables(env: Environ, opts: HostOptions, cwd: str) -> dict[str, str]:
    """What every host's launcher gets: forwarded, then ``.manygpu_env``, then ``-x``."""
    variables = envmod.forwarded(env)
    env_file = os.path.join(cwd, hosts.ENV_FILE)
    if os.path.isfile(env_file):
        variables |= hosts.parse_env_file(_read(env_file, "the file"), env_file)
    return variables | hosts.parse_exports(opts.exports, env)


def is_local_name(name: str) -> bool:
    """Whether host ``name`` is this machine (``localhost``, its name, one of its addresses)."""
    return name == "localhost" or is_local_address(name)


def here_facts(listed: Sequence[hosts.Host], cwd: str) -> hostplan.Here:
    """This machine's facts for the plan (resolves the host names)."""
    local = frozenset(h.name for h in listed if is_local_name(h.address))
    remote = [h for h in listed if h.name not in local]
    # Where the other hosts reach this one: the address on the route to them
    # (a host name that does not resolve here fails the preflight anyway).
    address = (source_address(remote[0].address) or socket.gethostname()) if remote else None
    return hostplan.Here(
        local_names=local,
        address=address,
        python=sys.executable,
        cwd=cwd,
        run_id=f"manygpu-{secrets.token_hex(8)}",
    )


def launch_hosts(req: LaunchRequest, opts: HostOptions, env: Environ, cwd: str) -> int:
    """Plan, check and run ``req`` over the hosts of ``opts``; the job's exit code."""
    per_host = req.nproc_per_node if isinstance(req.nproc_per_node, int) else None  # a word:
    listed = hosts.allocate(read_hosts(opts), opts.np, per_host)  # each host's own count
    hostplan.check_request(req, len(listed))  # before resolving any name
    here = here_facts(listed, cwd)
    plan = hostplan.plan(req, opts, listed, job_variables(env, opts, cwd), here)
    if opts.dry_run:
        print("\n".join(hostplan.dry_run(plan)))
        return 0
    runs_here = any(n.local for n in plan.nodes) or opts.remote_dir is None
    is_script = not (req.is_module or req.torchrun.no_python)
    missing = script_problem(req.entry, cwd) if runs_here and is_script else None
    if missing is not None:
        raise UsageError(missing)
    problem = preflight(plan, req.entry)
    if problem is not None:
        print(f"manygpu: {problem[0]}", file=sys.stderr)
        return problem[1]
    return Job(plan, env, JobSecret.draw()).run()


# -- preflight --------------------------------------------------------------------------


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _probe(node: NodeCommand, timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    assert node.probe is not None
    try:
        return subprocess.run(
            node.probe,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            input=json.dumps(node.env) + "\n",  # read by hostplan.BOOT, never on argv
        )
    except subprocess.TimeoutExpired:
        return None


def judge_probe(
    node: NodeCommand,
    res: subprocess.CompletedProcess[str] | None,
    here: dict[str, str],
    entry: str,
) -> tuple[str, int] | None:
    """One line and an exit code for what is wrong on ``node``'s host; ``None`` when fine."""
    host = node.host
    if res is None:
        return f"host {host} did not answer the preflight over ssh in time", SSH_FAILED
    if res.returncode == SSH_FAILED:
        why = _last_line(res.stderr) or "ssh exited 255"
        return (
            f"cannot reach host {host} over ssh: {why} (check the name, that sshd runs "
            "there, --ssh-port / --ssh-identity, and that `ssh HOST true` works)",
            SSH_FAILED,
        )
    try:
        facts = json.loads(_last_line(res.stdout))
        there = dict(facts["versions"])
    except (ValueError, KeyError, TypeError):
        why = _last_line(res.stderr) or f"exit code {res.returncode}"
        return (
            f"host {host} cannot run manygpu in {node.cwd} with {node.launch[0]}: {why} "
            "(install it there, or give --remote-python / --remote-dir)",
            1,
        )
    wrong = hostprobe.mismatch(here, host, there)
    if wrong is not None:
        return wrong, 1
    if facts.get("bind_error"):
        return (
            f"host {host} cannot serve the rendezvous: {facts['bind_error']}; "
            "choose another port with --master-port",
            1,
        )
    if facts.get("script_missing"):
        return f"host {host} has no script {entry!r} in {node.cwd}; copy it or give --remote-dir", 2
    return None


def preflight(plan: HostPlan, entry: str) -> tuple[str, int] | None:
    """Ask every other host at once; the first problem in host order, or ``None``."""
    if plan.store_node is not None and plan.nodes[plan.store_node].local:
        host, _, port = plan.endpoint.rpartition(":")
        why = hostprobe.bind_error(host.strip("[]"), int(port))
        if why is not None:
            return f"cannot serve the rendezvous here: {why}; choose another --master-port", 1
    remote = [n for n in plan.nodes if n.probe is not None]
    if not remote:
        return None
    timeout = plan.connect_timeout_s + PROBE_SLACK_S
    with ThreadPoolExecutor(max_workers=min(len(remote), 32)) as pool:
        answers = list(pool.map(lambda n: _probe(n, timeout), remote))
    here = hostprobe.versions()
    for node, res in zip(remote, answers, strict=True):
        problem = judge_probe(node, res, here, entry)
        if problem is not None:
            return problem
    return None


# -- running ----------------------------------------------------------------------------


def prefixed(host: str, line: str) -> str:
    """``[rank3]:text`` from host ``a`` -> ``a/3: text``; a launcher's own line -> ``a: line``."""
    match = _RANK_LINE.match(line)
    if match is not None:
        return f"{host}/{match[1]}: {match[2]}"
    return f"{host}: {line}"


@dataclass
class _Running:
    """One host's launcher while the job runs."""

    cmd: NodeCommand
    proc: subprocess.Popen[bytes]
    outcomes: list[blame.Outcome] = field(default_factory=list)
    last_error: str = ""
    ended_ns: int | None = None
    stopped: bool = False
    threads: list[threading.Thread] = field(default_factory=list)


class Job:
    """The hosts' launchers: started together, watched, stopped together."""

    def __init__(self, plan: HostPlan, env: Environ, secret: JobSecret) -> None:
        self.plan = plan
        self.env = env
        """This machine's environment, for the hosts that run here."""
        self.secret = secret
        """Drawn for this job; each host gets it on its stdin pipe."""
        self.nodes: list[_Running] = []
        self.signum: int | None = None
        self._lock = threading.Lock()

    def run(self) -> int:
        """Start every host, wait for the job, report; the job's exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            try:
                for cmd in self.plan.nodes:
                    self._start(cmd)
                self._wait()
            except (KeyboardInterrupt, _Stop) as stop:
                self.signum = stop.signum if isinstance(stop, _Stop) else signal.SIGINT
            self._stop_all()
        except (KeyboardInterrupt, _Stop):
            self._kill_all()  # a second Ctrl-C: no more waiting
        finally:
            self._kill_all()
            for s, handler in old.items():
                signal.signal(s, handler)
        for node in self.nodes:
            for t in node.threads:
                t.join(timeout=5)
        return self._report()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise _Stop(signum)

    def _start(self, cmd: NodeCommand) -> None:
        env = {k: v for k, v in self.env.items() if k != envmod.JOB_SECRET} if cmd.local else None
        proc = subprocess.Popen(
            cmd.argv,
            stdin=subprocess.PIPE,  # one line (the variables), then its end tells it to stop
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cmd.cwd if cmd.local else None,
            start_new_session=True,  # our Ctrl-C reaches the hosts through their stdin
        )
        assert proc.stdin is not None
        line = json.dumps({**cmd.env, envmod.JOB_SECRET: self.secret.text}) + "\n"
        with suppress(OSError):  # a host that died at once is reported as it ended
            proc.stdin.write(line.encode())
            proc.stdin.flush()
        node = _Running(cmd=cmd, proc=proc)
        for stream, dest in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            assert stream is not None
            t = threading.Thread(target=self._pump, args=(node, stream, dest), daemon=True)
            t.start()
            node.threads.append(t)
        self.nodes.append(node)

    def _pump(self, node: _Running, stream: IO[bytes], dest: IO[str]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            outcome = driven.parse(line) if dest is sys.stderr else None
            with self._lock:
                if outcome is not None:
                    node.outcomes.append(outcome)
                    continue
                if dest is sys.stderr and line.strip():
                    node.last_error = line.strip()
                dest.write(prefixed(node.cmd.host, line) + "\n")
                dest.flush()

    def _wait(self) -> None:
        """Until every host ends, or one fails and the job cannot go on without it."""
        while any(n.ended_ns is None for n in self.nodes):
            for node in self._newly_ended():
                if node.proc.returncode != 0 and not self._survives():
                    self._settle()
                    return
            time.sleep(0.05)

    def _newly_ended(self) -> list[_Running]:
        """The hosts whose launchers ended since the last look, stamped with when (for the
        blame's order)."""
        ended = [n for n in self.nodes if n.ended_ns is None and n.proc.poll() is not None]
        for node in ended:
            node.ended_ns = time.time_ns()
        return ended

    def _settle(self) -> None:
        """Until each other host has ended or reported a rank's end, or SETTLE_S."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            self._newly_ended()
            with self._lock:
                if all(n.ended_ns is not None or n.outcomes for n in self.nodes):
                    return
            time.sleep(0.05)

    def _survives(self) -> bool:
        """An elastic job goes on while at least MIN hosts still run or finished well."""
        if not self.plan.elastic:
            return False
        good = [n for n in self.nodes if n.ended_ns is None or n.proc.returncode == 0]
        return len(good) >= self.plan.min_nodes

    def _stop_all(self) -> None:
        """Close every host's stdin; wait for their launchers to stop their workers."""
        for node in self.nodes:
            if node.proc.poll() is None:
                node.stopped = True
                assert node.proc.stdin is not None
                with suppress(OSError):
                    node.proc.stdin.close()
        deadline = time.monotonic() + self.plan.grace_s + KILL_AFTER_S
        while time.monotonic() < deadline and any(n.proc.poll() is None for n in self.nodes):
            time.sleep(0.05)

    def _kill_all(self) -> None:
        """End what is left: SIGTERM to each host's ssh (or local launcher), then SIGKILL."""
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [n for n in self.nodes if n.proc.poll() is None]
            for node in alive:
                node.stopped = True
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.proc.pid, sig)
            deadline = time.monotonic() + wait_s
            while (
                alive and time.monotonic() < deadline and any(n.proc.poll() is None for n in alive)
            ):
                time.sleep(0.05)
        for node in self.nodes:
            node.proc.poll()
            if node.ended_ns is None:
                node.ended_ns = time.time_ns()

    def _report(self) -> int:
        return report(self.nodes, self.plan, self.signum)


def _host_failure(node: _Running) -> blame.Outcome | None:
    """A host that failed without a rank to blame: ssh lost, launcher error, stopped."""
    code = node.proc.returncode
    if code == 0 or node.outcomes:
        return None
    host, why = node.cmd.host, node.last_error
    if node.stopped:
        how = f"exit code {code}" if code >= 0 else signal.Signals(-code).name
        text = f"{host}: stopped ({how})"
    elif code == SSH_FAILED and not node.cmd.local:
        text = f"lost host {host}: {why or 'ssh exited 255'}"
    else:
        text = f"{host}: the launcher exited with code {code}" + (f": {why}" if why else "")
    return blame.Outcome(
        rank=-1,
        exit_code=code if code > 0 else 128 - code,
        time_ns=node.ended_ns or time.time_ns(),
        consequence=node.stopped,
        how=text,
    )


def report(nodes: Sequence[_Running], plan: HostPlan, signum: int | None) -> int:
    """Print how the job ended, the first failure first; the job's exit code."""
    if signum is not None:
        name = signal.Signals(signum).name
        print(f"manygpu: {name}: stopped the job on every host", file=sys.stderr)
        return 128 + signum
    failed = [n for n in nodes if n.proc.returncode != 0]
    if not failed:
        return 0
    finished = sum(1 for n in nodes if n.proc.returncode == 0)
    if plan.elastic and finished >= plan.min_nodes:
        for node in failed:
            lost = _host_failure(node)
            why = lost.how if lost else f"{node.cmd.host}: exit code {node.proc.returncode}"
            print(f"manygpu: the elastic job finished without a host ({why})", file=sys.stderr)
        return 0
    outcomes: list[tuple[str, blame.Outcome]] = []
    for node in nodes:
        outcomes += [(f"{node.cmd.host}: {o.how}", o) for o in node.outcomes]
        lost = _host_failure(node)
        if lost is not None:
            outcomes.append((lost.how, lost))
    if not outcomes:
        return 1
    for line in blame.report_lines(outcomes):  # the one rule, as on one node
        print(f"manygpu: {line}", file=sys.stderr)
    return blame.root_cause([o for _, o in outcomes]).exit_code
