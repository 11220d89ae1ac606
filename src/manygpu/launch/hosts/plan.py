"""Each host's command for a launch over several hosts, as a pure function.

One ``manygpu launch`` per host, all meeting at one c10d rendezvous (the
first host's, unless ``--rdzv-endpoint`` names another): hosts named as this
machine run it here, the others through the system's OpenSSH client, in the
same directory with the same Python unless ``--remote-dir`` /
``--remote-python`` say otherwise. ``--dry-run`` prints exactly these
commands. What the plan needs to know about this machine (which names are
local, its address, a fresh run id) is gathered by the caller and passed in
as :class:`Here`, so every rule is testable without a network.
"""

from __future__ import annotations

import ipaddress
import math
import shlex
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from manygpu.errors import UsageError
from manygpu.flags import flagged
from manygpu.launch.hosts.hostfile import Host
from manygpu.launch.netcheck import split_endpoint
from manygpu.launch.spec import (
    HostOptions,
    LaunchRequest,
    Placement,
    ProgramOptions,
    TorchrunOptions,
    parse_nnodes,
)
from manygpu.runtime.secret import is_loopback

DEFAULT_RDZV_PORT = 29400
"""torchrun's c10d port: where the hosts meet unless --master-port / --rdzv-endpoint say."""
BOOT = (
    "import json,os,sys;"
    'line=open(0,"rb",0,closefd=False).readline();'
    'line or sys.exit("manygpu: the driver sent no job description on stdin");'
    "os.environ.update(json.loads(line));"
    "os.execvp(sys.argv[1],sys.argv[1:])"
)
"""What each host runs first: read one JSON line of variables from stdin (the
ssh pipe the driver holds), set them, then become the real command (the same
Python, started anew: a ``--remote-python`` wrapper sees the variables). So values
(forwarded settings, API keys, the job secret) never sit on a command line,
where any local user reads them with ``ps``; and stdin stays open afterwards
as the driver's lifeline (:mod:`manygpu.launch.driven`). One byte at a time:
nothing after the line is consumed."""
SSH_KEEPALIVE = ("ServerAliveInterval=5", "ServerAliveCountMax=3")
"""A host that vanishes without closing its connection is noticed within 15 s."""
_PLACEMENT_FORWARDED = ("gpus", "rdzv_conf")
"""Placement flags every host gets as typed (the rest the plan decides)."""
_OWN_FLAGS = ("driven",)
"""Flags the plan sets itself, never copied from the request."""


@dataclass(frozen=True, kw_only=True)
class Here:
    """Facts about this machine that the plan depends on."""

    local_names: frozenset[str]
    """Host names, as typed, that are this machine (run without ssh)."""
    address: str | None
    """This machine's address on the route to the other hosts (``None``: none remote)."""
    python: str
    """This interpreter (``sys.executable``)."""
    cwd: str
    """The current directory."""
    run_id: str
    """A fresh rendezvous id for this job (``--rdzv-id`` replaces it)."""


@dataclass(frozen=True, kw_only=True)
class NodeCommand:
    """What one host runs, and how the driver starts it."""

    host: str
    """The host as typed."""
    local: bool
    """Runs here, without ssh."""
    nproc: int | None
    """Its processes (``None``: the host's own default)."""
    launch: tuple[str, ...]
    """``python -m manygpu launch ...`` as the host runs it."""
    env: dict[str, str]
    """Variables set for it (on top of the login environment on other hosts), sent as
    the JSON line :data:`BOOT` reads from its stdin, never on its command line."""
    cwd: str
    """Where it runs."""
    argv: tuple[str, ...]
    """What the driver executes here: ``launch`` itself, or ``ssh ... HOST 'cd ... && ...'``."""
    probe: tuple[str, ...] | None
    """The preflight over ssh (``None`` for this machine)."""

    def shown(self) -> str:
        """The exact command, for ``--dry-run``, and the names (not values) sent on its stdin."""
        sent = ", ".join(sorted(self.env)) or "nothing"
        if not self.local:
            return f"{self.host}: {shlex.join(self.argv)}  # stdin: {sent}"
        return f"{self.host} (here): {_shell(self.cwd, self.launch)}  # stdin: {sent}"


@dataclass(frozen=True, kw_only=True)
class HostPlan:
    """The job over hosts."""

    nodes: tuple[NodeCommand, ...]
    endpoint: str
    """``host:port`` of the c10d rendezvous."""
    store_node: int | None
    """Index of the node that hosts the rendezvous store (its port is checked first)."""
    min_nodes: int
    max_nodes: int
    grace_s: int
    """--term-timeout: how long stopped workers may take to exit."""
    connect_timeout_s: float
    """ssh's ConnectTimeout."""

    @property
    def elastic(self) -> bool:
        """Whether the job survives losing hosts (``--nnodes MIN:MAX``)."""
        return self.min_nodes < self.max_nodes


def booted(python: str, *args: str) -> tuple[str, ...]:
    """``python ARGS`` started through :data:`BOOT` (its variables come on stdin)."""
    return (python, "-c", BOOT, python, *args)


def _shell(cwd: str, argv: Sequence[str]) -> str:
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(argv)}"


def ssh_prefix(opts: HostOptions) -> list[str]:
    """ssh and its options: never a prompt, a bounded connect, no terminal.

    Options given here beat the user's ssh config, which otherwise applies
    (users, ports, jump hosts, keys), unless ``--ssh-config`` replaces it.
    """
    argv = ["ssh", "-T", "-o", "BatchMode=yes"]
    argv += ["-o", f"ConnectTimeout={math.ceil(opts.ssh_connect_timeout)}"]
    for keepalive in SSH_KEEPALIVE:
        argv += ["-o", keepalive]
    if opts.ssh_config is not None:
        argv += ["-F", opts.ssh_config]
    if opts.ssh_port is not None:
        argv += ["-p", str(opts.ssh_port)]
    if opts.ssh_identity is not None:
        argv += ["-i", opts.ssh_identity]
    return argv


def forwarded_flags(req: LaunchRequest) -> list[str]:
    """The request's options that every host's launcher gets as typed (defaults left out).

    Read from the fields' flag declarations, so a new launch option travels
    to other hosts without a change here.
    """
    out: list[str] = []
    groups: list[tuple[Any, type[Any], Sequence[str] | None]] = [
        (req, ProgramOptions, None),
        (req, Placement, _PLACEMENT_FORWARDED),
        (req.torchrun, TorchrunOptions, None),
    ]
    for obj, cls, only in groups:
        for f, flag in flagged(cls):
            value = getattr(obj, f.name)
            if (only is not None and f.name not in only) or f.name in _OWN_FLAGS:
                continue
            if value == f.default:
                continue
            if flag.switch:
                out.append(flag.names[0])
            elif isinstance(value, tuple):
                out += [flag.names[0], ",".join(str(v) for v in value)]
            else:
                out += [flag.names[0], str(value)]
    return out


def check_request(req: LaunchRequest, count: int) -> tuple[int, int]:
    """Refuse what a launch over ``count`` hosts decides itself; the node bounds."""
    given = [
        (req.node_rank is not None, "--node-rank", "every host gets its rank at the rendezvous"),
        (req.standalone, "--standalone", "it runs one node"),
        (req.rdzv_backend == "static", "--rdzv-backend static", "hosts meet over c10d"),
        (req.local_addr is not None, "--local-addr", "each host announces its own address"),
    ]
    for on, flag, why in given:
        if on:
            raise UsageError(f"-H/--hostfile starts every host: drop {flag} ({why})")
    return node_bounds(req.nnodes, count)


def node_bounds(nnodes: str | None, count: int) -> tuple[int, int]:
    """``--nnodes`` against the number of hosts: fixed N must be it, MIN:MAX must hold it."""
    lo, hi = parse_nnodes(nnodes) if nnodes is not None else (count, count)
    if lo == hi and lo != count:
        raise UsageError(
            f"--nnodes {nnodes} but the host list has {count} hosts; drop --nnodes "
            "or list that many hosts"
        )
    if not 1 <= lo <= count <= hi:
        raise UsageError(
            f"--nnodes {nnodes} must hold the {count} listed hosts (MIN <= {count} <= MAX)"
        )
    return lo, hi


def _endpoint(req: LaunchRequest, hosts: Sequence[Host], here: Here) -> tuple[str, int, int | None]:
    """(host, port, index of the listed host that serves it) of the rendezvous."""
    if req.rdzv_endpoint:
        host, port = split_endpoint(req.rdzv_endpoint, DEFAULT_RDZV_PORT)
    else:
        port = req.master_port if req.master_port is not None else DEFAULT_RDZV_PORT
        host = req.master_addr or ""
    if port == 0:
        raise UsageError("the hosts need a known rendezvous port; give a port other than 0")
    if not host:  # the first host's
        local = hosts[0].name in here.local_names
        return (here.address or "127.0.0.1") if local else hosts[0].address, port, 0
    for i, h in enumerate(hosts):
        if h.address == host or (h.name in here.local_names and host == here.address):
            return host, port, i
    return host, port, None


def plan(
    req: LaunchRequest,
    opts: HostOptions,
    hosts: Sequence[Host],
    env: Mapping[str, str],
    here: Here,
) -> HostPlan:
    """Every host's command for ``req`` on ``hosts`` (slots already allocated).

    Args:
        env: the variables every host's launcher gets (forwarded, ``.manygpu_env``,
            ``-x``), on top of its login environment.
    """
    lo, hi = check_request(req, len(hosts))
    here_too = [h.name for h in hosts if h.name in here.local_names]
    if len(here_too) > 1:
        raise UsageError(
            f"the host list names this machine {len(here_too)} times ({', '.join(here_too)}); "
            "list it once with all its slots"
        )
    host, port, store = _endpoint(req, hosts, here)
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    common = [
        "--nnodes",
        f"{lo}:{hi}" if lo != hi else str(lo),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        req.rdzv_id or here.run_id,
        *forwarded_flags(req),
    ]
    if req.torchrun.tee is None and req.torchrun.redirects is None:
        common += ["--tee", "3"]  # every line of a worker carries its rank
    tail = [*(["-m"] if req.is_module else []), req.entry, *req.args]
    job_env = {**env, **req.worker_env, "PYTHONUNBUFFERED": "1"}
    any_remote = any(h.name not in here.local_names for h in hosts)
    nodes = []
    for i, h in enumerate(hosts):
        local = h.name in here.local_names
        count = h.slots if h.slots is not None else req.nproc_per_node  # a word: the host's
        own = ["--nproc-per-node", str(count)] if count is not None else []
        if local and any_remote and here.address is not None:
            own += ["--local-addr", here.address]  # where the other hosts reach it
        python = here.python if local or opts.remote_python is None else opts.remote_python
        launch = booted(python, "-m", "manygpu", "launch", "--driven", *common, *own, *tail)
        cwd = here.cwd if local or opts.remote_dir is None else opts.remote_dir
        checks = _probe_args(req, endpoint if i == store else None)
        nodes.append(_node(h, local, launch, job_env, cwd, opts, checks))
    return HostPlan(
        nodes=tuple(nodes),
        endpoint=endpoint,
        store_node=store,
        min_nodes=lo,
        max_nodes=hi,
        grace_s=req.shutdown_grace_s,
        connect_timeout_s=opts.ssh_connect_timeout,
    )


def _probe_args(req: LaunchRequest, bind: str | None) -> list[str]:
    """What the preflight checks on a host: the store's port (its host only), the script."""
    args = ["--bind", bind] if bind is not None else []
    if not req.is_module and not req.torchrun.no_python:
        args += ["--script", req.entry]
    return args


def _node(
    h: Host,
    local: bool,
    launch: tuple[str, ...],
    env: dict[str, str],
    cwd: str,
    opts: HostOptions,
    probe_args: list[str],
) -> NodeCommand:
    if local:
        return NodeCommand(
            host=h.name,
            local=True,
            nproc=h.slots,
            launch=launch,
            env=env,
            cwd=cwd,
            argv=launch,
            probe=None,
        )
    ssh = ssh_prefix(opts)
    probe = booted(launch[0], "-m", "manygpu.launch.hosts.probe", *probe_args)
    return NodeCommand(
        host=h.name,
        local=False,
        nproc=h.slots,
        launch=launch,
        env=env,
        cwd=cwd,
        argv=(*ssh, h.name, _shell(cwd, launch)),
        probe=(*ssh, h.name, _shell(cwd, probe)),
    )


def dry_run(plan_: HostPlan, resolve: Callable[[str], Sequence[str]] | None = None) -> list[str]:
    """The lines ``--dry-run`` prints: the rendezvous (and a warning when the other hosts
    could not reach it), then each host's exact command.

    Args:
        resolve: a host name's addresses (default: this machine's resolver).
    """
    nodes = f"{plan_.min_nodes}..{plan_.max_nodes}" if plan_.elastic else f"{plan_.max_nodes}"
    nodes += " host" if nodes == "1" else " hosts"
    head = f"# {nodes}, rendezvous {plan_.endpoint} (c10d); each line runs on its host"
    warning = loopback_warning(plan_, resolve or resolved_addresses)
    return [head, *([warning] if warning else []), *(node.shown() for node in plan_.nodes)]


def loopback_warning(plan_: HostPlan, resolve: Callable[[str], Sequence[str]]) -> str | None:
    """One line when the rendezvous host is loopback here while some hosts are remote.

    The doctor's rule for gloo's interface, applied to the rendezvous: a loopback
    address (127.0.0.1, or Debian's 127.0.1.1 for the hostname) is fine on one node
    and unreachable from every other one, so their launchers would wait and time out.
    """
    remote = [n.host for n in plan_.nodes if not n.local]
    host, _ = split_endpoint(plan_.endpoint, DEFAULT_RDZV_PORT)
    if not remote:
        return None
    addresses = [host] if is_loopback(host) else list(resolve(host))
    if not addresses or not all(_is_loopback_address(a) for a in addresses):
        return None
    shown = host if addresses == [host] else f"{host} ({', '.join(addresses)})"
    return (
        f"# warning: the rendezvous host {shown} is loopback here, which "
        f"{', '.join(remote)} cannot reach; give --master-addr (or --rdzv-endpoint) this "
        "machine's address on their network"
    )


def _is_loopback_address(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return address == "localhost"


def resolved_addresses(host: str) -> list[str]:
    """``host``'s addresses from this machine's resolver (none when it does not resolve:
    the preflight reports that)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return sorted({str(info[4][0]) for info in infos})
