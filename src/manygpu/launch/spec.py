"""What to launch, as one validated, frozen dataclass (the CLI only fills it in)."""

from __future__ import annotations

from dataclasses import dataclass, field

from manygpu.errors import UsageError

RDZV_BACKENDS = ("static", "c10d")
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


AGREED_ID = "manygpu-agreed"
"""Run id meaning: the store's host draws a random one, the other nodes read it."""


@dataclass(frozen=True, kw_only=True)
class TorchrunOptions:
    """torchrun's flags with torchrun's meaning, for scripts launched as with torchrun."""

    no_python: bool = False
    """Run the entry as an executable, not with Python (--no-python)."""
    tee: str | None = None
    """Also write these streams to the log files: 0-3 or per rank "0:1,1:2" (--tee)."""
    redirects: str | None = None
    """Send these streams to the log files only (--redirects)."""
    local_ranks_filter: tuple[int, ...] | None = None
    """Show only these local ranks' output on the console (--local-ranks-filter)."""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks of its workers (--monitor-interval)."""
    role: str = "worker"
    """The workers' role name (--role)."""
    start_method: str = "spawn"
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
class LaunchSpec:
    """A job: which program, how many processes, where they meet."""

    entry: str
    """Script path, or module name when ``is_module``."""
    is_module: bool = False
    """Run ``entry`` like ``python -m entry``."""
    args: tuple[str, ...] = ()
    """Arguments passed to the program."""
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
    max_restarts: int = 0
    """Restart the workers this many times after a failure."""
    timeout_s: float | None = None
    """Rendezvous and collective timeout; exported to workers as ``MANYGPU_TIMEOUT``."""
    shutdown_grace_s: int = 120
    """Seconds between SIGTERM and SIGKILL when stopping workers: the time a
    preempted job has to save (keep it below Slurm's KillWait / --signal lead)."""
    log_dir: str | None = None
    """Where workers' logs go (a temporary folder when ``None``)."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Extra rendezvous settings, as torchrun's ``--rdzv-conf`` (e.g. last_call_timeout)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Variables set for the workers (e.g. ``OMP_NUM_THREADS``)."""
    torchrun: TorchrunOptions = field(default_factory=TorchrunOptions)
    """torchrun's own flags (tee, redirects, --no-python ...)."""

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
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.gpus is not None and len(self.gpus) != self.nproc_per_node:
            raise UsageError(
                f"--gpus lists {len(self.gpus)} GPUs "
                f"but --nproc-per-node is {self.nproc_per_node}; "
                "give one or the other"
            )
