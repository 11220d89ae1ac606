"""What to launch, as validated, frozen dataclasses; the launch options are declared here once.

Each option names its command-line flags on its field (:mod:`manygpu.flags`);
the CLI builds its arguments, and the request back from them, by field name.
:class:`LaunchRequest` holds the options as typed; resolving it
(:mod:`manygpu.launch.resolve`) gives a :class:`LaunchSpec`. The options the
launcher uses as given (:class:`ProgramOptions`, :class:`TorchrunOptions`) are
shared by the request and the spec, so a new one of those is one field.
Plain data: importing this module must stay cheap (it builds ``manygpu --help``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from manygpu.errors import UsageError
from manygpu.flags import (
    HIDDEN,
    nonnegative_int,
    nproc_value,
    option,
    positive_float,
    positive_int,
    switch,
)

RDZV_BACKENDS = ("c10d", "static")
START_METHODS = ("spawn", "fork", "forkserver")


def _std_spec(flag: str, value: str | None) -> None:
    """torchrun's 0-3 or per-rank ``0:1,1:2`` for --tee / --redirects."""
    if value is None:
        return
    parts = [p.split(":", 1)[-1] for p in value.split(",")] if ":" in value else [value]
    if not all(p.strip() in ("0", "1", "2", "3") for p in parts):
        raise UsageError(
            f"{flag} {value!r}: give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
            "or per local rank like 0:3,1:2"
        )


def parse_ranks(text: str | None) -> tuple[int, ...] | None:
    """``"0,2"`` -> (0, 2) for --local-ranks-filter."""
    if text is None:
        return None
    parts = [t.strip() for t in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise UsageError(f"--local-ranks-filter {text!r}: give local ranks like 0 or 0,2")
    return tuple(int(p) for p in parts)


def gpu_indices(text: str) -> tuple[int, ...] | None:
    """``"0,2"`` -> (0, 2) for --gpus; ``"all"`` -> ``None`` (every GPU there is).

    Only the form: whether those GPUs exist is the resolver's question (it needs
    torch). Checked when the request is made, so a typo costs no torch import.
    """
    if text.strip().lower() == "all":
        return None
    parts = [p.strip() for p in text.split(",")]
    if any(not (p.isascii() and p.isdigit()) for p in parts):
        raise UsageError(
            f"--gpus {text!r} is not a list of GPU indices; write e.g. --gpus 0,1 or --gpus all"
        )
    indices = tuple(int(p) for p in parts)
    if len(set(indices)) != len(indices):
        raise UsageError(f"--gpus {text!r} names a GPU twice; list each GPU once")
    return indices


def parse_nnodes(text: str, where: str | None = None) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4): the one reader of a node count or range.

    Every ``--nnodes`` (launch, the hostfile's driver, ``k8s render``) and every
    engine's node count (``PET_NNODES``, ``NNODES``) is read here, so each accepts
    the same forms and refuses the same way. ``where`` names the source in the
    error (default ``--nnodes TEXT``; an engine's is ``PET_NNODES='TEXT'``).
    """
    where = where or f"--nnodes {text}"
    parts = text.strip().split(":")
    if len(parts) > 2 or not all(p.isascii() and p.isdigit() and int(p) >= 1 for p in parts):
        raise UsageError(f"{where}: give a node count N or a range MIN:MAX (each >= 1)")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo > hi:
        raise UsageError(f"{where}: MIN is above MAX")
    return lo, hi


AGREED_ID = "manygpu-agreed"
"""Run id meaning: the store's host draws a random one, the other nodes read it."""


@dataclass(frozen=True, kw_only=True)
class TorchrunOptions:
    """torchrun's flags with torchrun's meaning, for scripts launched as with torchrun."""

    no_python: bool = switch(
        "--no-python", "--no_python", help="run SCRIPT as an executable, not with python"
    )
    """Run the entry as an executable, not with Python (--no-python)."""
    run_path: bool = switch(
        "--run-path",
        "--run_path",
        help="run SCRIPT with runpy.run_path (what manygpu does anyway)",
    )
    """Accepted for torchrun's --run-path; scripts always run with ``runpy.run_path``."""
    tee: str | None = option("-t", "--tee", help="also log these streams: 0-3 or per rank 0:1,1:2")
    """Also write these streams to the log files: 0-3 or per rank "0:1,1:2" (--tee)."""
    redirects: str | None = option(
        "-r", "--redirects", help="log these streams only: 0-3 or per rank 0:1,1:2"
    )
    """Send these streams to the log files only (--redirects)."""
    local_ranks_filter: tuple[int, ...] | None = option(
        "--local-ranks-filter",
        "--local_ranks_filter",
        help="show only these local ranks' output, e.g. 0 or 0,2",
        convert=parse_ranks,
    )
    """Show only these local ranks' output on the console (--local-ranks-filter)."""
    monitor_interval: float = option(
        "--monitor-interval",
        "--monitor_interval",
        default=0.1,
        parse=positive_float,
        help="seconds between worker checks",
    )
    """Seconds between the agent's checks of its workers (--monitor-interval)."""
    role: str = option("--role", default="worker", help="the workers' role name")
    """The workers' role name (--role)."""
    start_method: str = option(
        "--start-method", "--start_method", default="spawn", choices=START_METHODS
    )
    """How the agent starts workers (--start-method)."""

    def __post_init__(self) -> None:
        _std_spec("--tee", self.tee)
        _std_spec("--redirects", self.redirects)
        interval = self.monitor_interval
        if not isinstance(interval, int | float) or not 0 < interval < float("inf"):
            raise UsageError(f"--monitor-interval must be a number of seconds > 0, got {interval}")
        if self.start_method not in START_METHODS:
            raise UsageError(
                f"--start-method {self.start_method!r}: choose one of {', '.join(START_METHODS)}"
            )
        if not self.role or not self.role.replace("_", "").replace("-", "").isalnum():
            raise UsageError(f"--role {self.role!r}: give a plain name, e.g. worker")


@dataclass(frozen=True, kw_only=True)
class ProgramOptions:
    """How the launcher runs the program, used as given: the program, restarts, timeouts, logs.

    Shared by :class:`LaunchRequest` and :class:`LaunchSpec` (resolving copies
    them over by name); checked by the spec.
    """

    entry: str
    """Script path, or module name when ``is_module``."""
    is_module: bool = False
    """Run ``entry`` like ``python -m entry``."""
    args: tuple[str, ...] = ()
    """Arguments passed to the program."""
    max_restarts: int = option("--max-restarts", "--max_restarts", default=0, parse=positive_int)
    """Restart the workers this many times after a failure."""
    timeout_s: float | None = option(
        "--timeout",
        parse=positive_float,
        help=(
            "seconds before a stuck collective fails (manygpu's own, and every process "
            "group a script creates without timeout=; default: 180 for manygpu's, torch's "
            "30 min for others) or nodes stop waiting for each other (default 300)"
        ),
    )
    """Rendezvous and collective timeout; exported to workers as ``MANYGPU_TIMEOUT``."""
    log_dir: str | None = option("--log-dir", "--log_dir", help="keep workers' logs here")
    """Where workers' logs go (a temporary folder when ``None``)."""
    shutdown_grace_s: int = option(
        "--term-timeout",
        default=120,
        parse=nonnegative_int,
        metavar="TERM_TIMEOUT_S",
        help="seconds stopped workers get between SIGTERM and SIGKILL, e.g. to "
        "save a checkpoint on preemption (default 120)",
    )
    """Seconds between SIGTERM and SIGKILL when stopping workers: the time a
    preempted job has to save (keep it below Slurm's KillWait / --signal lead)."""
    servers: int | None = option(
        "--ps",
        parse=positive_int,
        metavar="K",
        help="parameter servers: the first K ranks serve the others (strategy 'ps'); "
        "a worker killed by a signal is then left to them (async training goes on)",
    )
    """The first ``K`` ranks are parameter servers (handed to workers as ``MANYGPU_PS_SERVERS``)."""
    job_secret_file: str | None = option(
        "--job-secret-file",
        help="file (mode 600) holding the secret every node of a multi-node job shares "
        "(or MANYGPU_JOB_SECRET; -H/--hostfile draws one)",
    )
    """Where this node reads the job's secret (:mod:`manygpu.runtime.secret`)."""
    driven: bool = switch("--driven", help=HIDDEN)
    """Started by a launch over several hosts (:mod:`manygpu.launch.hosts.run`): stop the
    workers when stdin closes (the driver or its ssh connection went away) and report
    failures as lines the driver reads (:mod:`manygpu.launch.driven`)."""
    torchrun: TorchrunOptions = field(default_factory=TorchrunOptions)
    """torchrun's own flags (tee, redirects, --no-python ...)."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the workers run and how many, as typed; ``None`` means "not given"."""

    gpus: str | None = option(
        "--gpus", help="GPUs to use, e.g. 0,1 or all (sets CUDA_VISIBLE_DEVICES)"
    )
    """GPU indices as typed (``"0,1"`` or ``"all"``)."""
    nproc_per_node: int | str | None = option(
        "--nproc-per-node",
        "--nproc_per_node",
        parse=nproc_value,
        help="workers on this node: a number, or torchrun's auto (GPUs, else CPUs), "
        "cpu (CPUs) or gpu (GPUs) (default: GPUs, or 2 on CPU)",
    )
    """Workers on this node, or one of torchrun's words (resolved on the node)."""
    nnodes: str | None = option("--nnodes", help="nodes: N, or MIN:MAX for an elastic job")
    """Nodes: ``"N"``, or ``"MIN:MAX"`` for an elastic job."""
    node_rank: int | None = option("--node-rank", "--node_rank", parse=positive_int)
    """This node's index (static rendezvous)."""
    master_addr: str | None = option(
        "--master-addr", "--master_addr", help="address of node 0 (static rendezvous)"
    )
    """Address of node 0."""
    master_port: int | None = option("--master-port", "--master_port", parse=positive_int)
    """Port of node 0's store."""
    rdzv_endpoint: str | None = option(
        "--rdzv-endpoint", "--rdzv_endpoint", help="HOST:PORT of the c10d rendezvous (elastic jobs)"
    )
    """``HOST:PORT`` of the rendezvous store."""
    rdzv_backend: str | None = option("--rdzv-backend", "--rdzv_backend", choices=RDZV_BACKENDS)
    """``"c10d"`` or ``"static"``; ``None`` picks by the node count."""
    rdzv_id: str | None = option("--rdzv-id", "--rdzv_id", help="job id shared by all nodes")
    """Job id shared by all nodes; ``None`` draws a fresh one."""
    rdzv_conf: str | None = option(
        "--rdzv-conf",
        "--rdzv_conf",
        help="rendezvous settings KEY=VALUE,... (e.g. last_call_timeout=5)",
    )
    """Rendezvous settings as typed, ``KEY=VALUE,...``."""
    local_addr: str | None = option(
        "--local-addr", "--local_addr", help="address this node announces to the others"
    )
    """Address this node announces to the others."""

    def __post_init__(self) -> None:
        if self.gpus is not None:
            gpu_indices(self.gpus)  # the form alone: before torch loads


@dataclass(frozen=True, kw_only=True)
class LaunchRequest(ProgramOptions, Placement):
    """The launch options as typed; ``None`` means "not given"."""

    standalone: bool = switch("--standalone", help="one node, private rendezvous (the default)")
    """torchrun --standalone: one node and a private rendezvous (checked, then our default)."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Variables for the workers on top of manygpu's (e.g. a launched tool's configuration)."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec(ProgramOptions):
    """A job: which program, how many processes, where they meet."""

    nproc_per_node: int = 1
    """Worker processes on this node."""
    gpus: tuple[str, ...] | None = None
    """``CUDA_VISIBLE_DEVICES`` entries for the workers, one per process."""
    min_nodes: int = 1
    """Nodes needed to start (elastic lower bound)."""
    max_nodes: int = 1
    """Nodes allowed (elastic upper bound)."""
    node_rank: int = 0
    """This node's index (static rendezvous only)."""
    rdzv_backend: str = "c10d"
    """``"c10d"`` (elastic, torchrun --standalone) or ``"static"`` (fixed ranks)."""
    rdzv_endpoint: str = "127.0.0.1:0"
    """``host:port`` of the rendezvous store; port 0 picks a free one (one node)."""
    rdzv_id: str = "manygpu"
    """Job id shared by every node of the job."""
    local_addr: str | None = None
    """Address this node announces to the others (``MASTER_ADDR`` of its workers)."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Extra rendezvous settings, as torchrun's ``--rdzv-conf`` (e.g. last_call_timeout)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Variables set for the workers (e.g. ``OMP_NUM_THREADS``)."""
    note: str | None = None
    """Said once on start: how the cluster engine's variables were read, where they
    could be misread (:mod:`manygpu.launch.engines`)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise UsageError(
                f"--nnodes {self.min_nodes}:{self.max_nodes} is not a valid range "
                "(need 1 <= MIN <= MAX)"
            )
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise UsageError(
                f"unknown --rdzv-backend {self.rdzv_backend!r}; "
                f"choose one of {', '.join(RDZV_BACKENDS)}"
            )
        if self.rdzv_backend == "static" and not 0 <= self.node_rank < self.max_nodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is outside 0..{self.max_nodes - 1} "
                f"for --nnodes {self.max_nodes}"
            )
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        ranks = self.nproc_per_node * self.min_nodes
        if self.servers is not None and not 1 <= self.servers < ranks:
            raise UsageError(
                f"--ps {self.servers}: give 1 to {ranks - 1} servers, so that at least one "
                f"of the job's {ranks} processes is a worker"
            )
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.gpus is not None and len(self.gpus) != self.nproc_per_node:
            raise UsageError(
                f"--gpus lists {len(self.gpus)} GPUs "
                f"but --nproc-per-node is {self.nproc_per_node}; "
                "give one or the other"
            )


def _exports(values: list[str] | None) -> tuple[str, ...]:
    """``-x`` given several times -> a tuple (checked when the hosts are planned)."""
    return tuple(values or ())


@dataclass(frozen=True, kw_only=True)
class HostOptions:
    """One command starts the job on several hosts, over ssh (``-H`` / ``--hostfile``).

    Without ``-H`` or ``--hostfile`` only ``-np`` applies: processes on this machine.
    """

    hosts: str | None = option(
        "-H",
        "--hosts",
        help="run on these hosts, HOST[:SLOTS],... (over ssh; local names run here)",
    )
    """Hosts as typed, Horovod's and mpirun's ``-H a:4,b:4``; a host without slots runs
    --nproc-per-node processes (default: its GPUs, or 2 on a CPU)."""
    hostfile: str | None = option(
        "--hostfile", help="file of hosts: 'HOST:SLOTS' or 'HOST slots=N' lines, # comments"
    )
    """A file of hosts (Horovod ``host:slots``, OpenMPI / DeepSpeed ``host slots=N``)."""
    np: int | None = option(
        "-np",
        "--np",
        parse=positive_int,
        help="processes in all (default: every slot); without -H: processes on this machine",
    )
    """Processes in all, filled into the hosts' slots in order."""
    exports: tuple[str, ...] = option(
        "-x",
        "--export",
        repeat=True,
        convert=_exports,
        metavar="KEY[=VALUE]",
        help="set KEY=VALUE, or pass this KEY, on every host (repeatable, as mpirun -x)",
    )
    """``-x KEY[=VALUE]`` as given."""
    ssh_port: int | None = option("--ssh-port", parse=positive_int, help="ssh port of the hosts")
    """ssh's ``-p``."""
    ssh_identity: str | None = option("--ssh-identity", help="ssh private key file (ssh -i)")
    """ssh's ``-i``."""
    ssh_config: str | None = option(
        "--ssh-config", help="ssh config file to use instead of ~/.ssh/config (ssh -F)"
    )
    """ssh's ``-F``; ``None`` keeps the user's own ssh configuration."""
    ssh_connect_timeout: float = option(
        "--ssh-connect-timeout",
        default=10.0,
        parse=positive_float,
        help="seconds to wait for a host's ssh connection (default 10)",
    )
    """ssh's ``ConnectTimeout``: how soon an unreachable host is named."""
    remote_python: str | None = option(
        "--remote-python", help="Python on the other hosts (default: this one's path)"
    )
    """The interpreter other hosts run (default: ``sys.executable``)."""
    remote_dir: str | None = option(
        "--remote-dir", help="working directory on the other hosts (default: this one)"
    )
    """Where other hosts run (default: the current directory)."""
    dry_run: bool = switch("--dry-run", help="print each host's command and exit")
    """Print the command each host would run, start nothing."""

    def __post_init__(self) -> None:
        if self.hosts is not None and self.hostfile is not None:
            raise UsageError("give -H/--hosts or --hostfile, not both")
        if self.np is not None and self.np < 1:
            raise UsageError(f"-np must be at least 1, got {self.np}")
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise UsageError(f"--ssh-port {self.ssh_port} is outside 1..65535")
        if not self.given:
            used = [flag for flag, value in self._ssh_flags() if value]
            if used:
                raise UsageError(f"{used[0]} is for a launch over hosts; add -H or --hostfile")

    @property
    def given(self) -> bool:
        """Whether the job runs on a list of hosts."""
        return self.hosts is not None or self.hostfile is not None

    def _ssh_flags(self) -> list[tuple[str, object]]:
        return [
            ("-x", self.exports),
            ("--ssh-port", self.ssh_port),
            ("--ssh-identity", self.ssh_identity),
            ("--ssh-config", self.ssh_config),
            ("--remote-python", self.remote_python),
            ("--remote-dir", self.remote_dir),
            ("--dry-run", self.dry_run),
        ]
