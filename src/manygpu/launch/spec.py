"""What to launch, as one validated, frozen dataclass (the CLI only fills it in)."""

from __future__ import annotations

from dataclasses import dataclass, field

from manygpu.errors import UsageError

RDZV_BACKENDS = ("static", "c10d")


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
