"""The one place that reads environment variables.

Every other module asks this one, so the rules of precedence (torchrun before
Slurm before MPI) and the defaults live together and are testable with plain
dictionaries instead of a patched ``os.environ``.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping

from manygpu.errors import UsageError

Environ = Mapping[str, str]

DEFAULT_TIMEOUT_S = 180.0
"""Collective / rendezvous timeout a human would wait for, not torch's 30 minutes."""


def current() -> Environ:
    """Snapshot of this process's environment."""
    return dict(os.environ)


def get_int(env: Environ, *names: str) -> int | None:
    """First of ``names`` that is set, as an int; ``None`` when none is set."""
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            try:
                return int(value)
            except ValueError:
                raise UsageError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def get_str(env: Environ, *names: str) -> str | None:
    """First of ``names`` that is set and non-empty."""
    for name in names:
        value = env.get(name)
        if value:
            return value
    return None


def timeout_s(env: Environ) -> float:
    """Collective timeout: ``MANYGPU_TIMEOUT`` seconds, else the default."""
    return _seconds(env, "MANYGPU_TIMEOUT", DEFAULT_TIMEOUT_S, zero_ok=False)


DEFAULT_EXIT_GRACE_S = 10.0
"""How long a worker may take to exit once its script has returned."""


def exit_grace_s(env: Environ) -> float:
    """``MANYGPU_EXIT_GRACE`` seconds (0 turns the exit timer off), else the default."""
    return _seconds(env, "MANYGPU_EXIT_GRACE", DEFAULT_EXIT_GRACE_S, zero_ok=True)


def _seconds(env: Environ, name: str, default: float, *, zero_ok: bool) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise UsageError(f"{name}={raw!r} is not a number of seconds {bound}; fix or unset it")
    return value


PS_SERVERS = "MANYGPU_PS_SERVERS"
"""How many of the first ranks are parameter servers (``manygpu launch --ps K``)."""


def launched_servers(env: Environ) -> int | None:
    """The ``K`` of ``manygpu launch --ps K``; ``None`` when the job has no servers."""
    value = get_int(env, PS_SERVERS)
    if value is not None and value < 1:
        raise UsageError(f"{PS_SERVERS}={value} must be >= 1; fix or unset it")
    return value


EXPENDABLE_FROM = "MANYGPU_EXPENDABLE_FROM"
"""Ranks from this one on may be lost to a signal without ending the job (the job's
other ranks decide): set by ``manygpu launch --ps K`` to ``K``, the first worker."""


def expendable_from(env: Environ) -> int | None:
    """The first rank that may be lost without ending the job; ``None``: none may."""
    value = get_int(env, EXPENDABLE_FROM)
    if value is not None and value < 0:
        raise UsageError(f"{EXPENDABLE_FROM}={value} must be >= 0; fix or unset it")
    return value


TOOL_CONFIG = "MANYGPU_TOOL_CONFIG"
"""Where a launched tool's command hands its workers their configuration (JSON)."""


def tool_config(env: Environ) -> str | None:
    """The configuration a tool's command handed this worker, ``None`` when none did."""
    return env.get(TOOL_CONFIG) or None


def error_file(env: Environ) -> str | None:
    """Where torch elastic's agent wants this worker's error (``TORCHELASTIC_ERROR_FILE``)."""
    return get_str(env, "TORCHELASTIC_ERROR_FILE")


_DEBUG_STRICT = {"strict", "2"}


def launcher_defaults(env: Environ, given: Mapping[str, object]) -> dict[str, str]:
    """``manygpu launch --strategy/--precision``: defaults for the ``Parallel`` fields the
    code did not give (``MANYGPU_STRATEGY``, ``MANYGPU_PRECISION``). A mesh in the
    code implies its own strategy, so the launcher's does not apply then."""
    out: dict[str, str] = {}
    strategy, precision = get_str(env, "MANYGPU_STRATEGY"), get_str(env, "MANYGPU_PRECISION")
    if strategy and "strategy" not in given and "mesh" not in given:
        out["strategy"] = strategy
    if precision and "precision" not in given:
        out["precision"] = precision
    return out


def traceback_wanted(env: Environ) -> bool:
    """``MANYGPU_TRACEBACK=1``: a worker's configuration error prints its traceback too
    (by default the launcher's one line says it, once for every rank alike)."""
    return env.get("MANYGPU_TRACEBACK", "0").lower() in {"1", "true", "yes", "on"}


def gc_freeze_wanted(env: Environ) -> bool:
    """``MANYGPU_GC_FREEZE=0`` keeps torch's objects in Python's collector in launched
    workers and the ``manygpu`` command (see :mod:`manygpu.runtime.heap`); on by default."""
    return env.get("MANYGPU_GC_FREEZE", "1").lower() not in {"0", "false", "no", "off"}


def fp8_emulate(env: Environ) -> bool:
    """``MANYGPU_FP8_EMULATE=1``: ``precision="fp8"`` through torchao's emulation on any
    device, the CPU included. For tests: slow, a CPU-only numerics check."""
    return env.get("MANYGPU_FP8_EMULATE", "0").lower() in {"1", "true", "yes", "on"}


def debug_enabled(env: Environ) -> bool:
    """``MANYGPU_DEBUG=1`` (or ``strict``) turns on cross-rank consistency checks."""
    value = env.get("MANYGPU_DEBUG", "0").lower()
    return value in {"1", "true", "yes", "on"} or value in _DEBUG_STRICT


def debug_strict(env: Environ) -> bool:
    """``MANYGPU_DEBUG=strict`` (or ``2``): the checks compare each call's site too."""
    return env.get("MANYGPU_DEBUG", "0").lower() in _DEBUG_STRICT


def horovod_dynamic_process_sets(env: Environ) -> bool:
    """``HOROVOD_DYNAMIC_PROCESS_SETS=1``: manygpu.horovod lets ranks add and remove
    process sets after ``hvd.init()``, as Horovod does with this variable."""
    return env.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").lower() in {"1", "true", "yes", "on"}


def user_set_threads(env: Environ) -> bool:
    """Whether the user chose a thread count, which we then respect."""
    return bool(env.get("OMP_NUM_THREADS"))


def user_set_malloc(env: Environ) -> bool:
    """Whether the user tuned glibc's malloc (a ``MALLOC_*`` variable or a
    ``glibc.malloc.*`` tunable in ``GLIBC_TUNABLES``); theirs then stands alone."""
    return any(name.startswith("MALLOC_") for name in env) or "glibc.malloc." in env.get(
        "GLIBC_TUNABLES", ""
    )


def agent_store_attempt(env: Environ) -> int | None:
    """The restart count when torch elastic's agent hosts the store, else ``None``."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    return get_int(env, "TORCHELASTIC_RESTART_COUNT") or 0


def visible_devices(env: Environ) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` split into entries, ``None`` when unset."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [part.strip() for part in raw.split(",") if part.strip()]


JOB_SECRET = "MANYGPU_JOB_SECRET"
"""The job's secret for a multi-node job (:mod:`manygpu.runtime.secret`)."""


def drop_job_secret() -> None:
    """Remove the job secret from this process's environment, which workers inherit."""
    os.environ.pop(JOB_SECRET, None)


VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""What a shell accepts as a variable name; nothing else is forwarded to a host."""

FORWARD_PREFIXES = ("NCCL_", "GLOO_", "MANYGPU_", "MALLOC_", "AWS_", "AZURE_STORAGE_")
"""Variables a launch over several hosts hands to every host: the collectives'
settings, glibc's allocator's, ours, and the object stores' (checkpoints to
``s3://`` / ``az://`` need the same endpoint and credentials on every rank; like
every forwarded value they travel as JSON on the launch's own channel, never on a
command line). Everything else stays here unless ``-x`` names it."""
FORWARD_NAMES = (
    "PYTHONPATH", "CUDA_DEVICE_ORDER", "GLIBC_TUNABLES",
    "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
)  # fmt: skip
FORWARD_SUFFIX = "_VISIBLE_DEVICES"
"""CUDA_VISIBLE_DEVICES and its kin (HIP_, ROCR_, NVIDIA_...)."""


def forwarded(env: Environ) -> dict[str, str]:
    """The variables of ``env`` that other hosts of the job get, as mpirun / DeepSpeed do.

    Never the job secret (a launch over hosts draws its own), and only names a
    shell could hold: the values travel as JSON, but a name is still checked
    (``NCCL_$(cmd)X`` is refused in one line, never run anywhere).
    """
    out = {}
    for name, value in env.items():
        if name == JOB_SECRET or not (
            name.startswith(FORWARD_PREFIXES)
            or name in FORWARD_NAMES
            or name.endswith(FORWARD_SUFFIX)
        ):
            continue
        if not VARIABLE_NAME.fullmatch(name):
            raise UsageError(
                f"environment variable {name!r} would go to every host but is not a "
                "variable name ([A-Za-z_][A-Za-z0-9_]*); unset it"
            )
        out[name] = value
    return out


EVIDENCE_DIR = "MANYGPU_EVIDENCE_DIR"
"""Where a launched worker reports waits and answers the launcher's hang questions."""


def evidence_dir(env: Environ) -> str | None:
    """This worker's evidence directory (``manygpu launch`` sets it), ``None`` elsewhere."""
    return env.get(EVIDENCE_DIR) or None


FLIGHT_RECORDER = "TORCH_FR_BUFFER_SIZE"
"""torch's Flight Recorder: how many collectives each process keeps records of."""


def export_evidence(where: str, records: int, host: str) -> None:
    """Set, for the workers this launcher starts, where their evidence goes and how
    their host is named, and turn torch's Flight Recorder on with ``records``
    entries unless the user sized it."""
    os.environ[EVIDENCE_DIR] = where
    os.environ[HOST_LABEL] = host
    os.environ.setdefault(FLIGHT_RECORDER, str(records))


HOST_LABEL = "MANYGPU_HOST"
"""How verdicts name this worker's host (the launcher sets it: its address on the job's network)."""


def host_label(env: Environ) -> str | None:
    """This worker's host as the launcher names it, ``None`` when not launched by manygpu."""
    return get_str(env, HOST_LABEL)


def host_name(env: Environ) -> str:
    """This worker's host as verdicts, traces and trackers name it: the launcher's
    label, else the machine's hostname."""
    return host_label(env) or socket.gethostname()


STRAGGLERS = "MANYGPU_STRAGGLERS"
"""Straggler reports: ``0`` turns them off, a number N reports every N steps."""


def straggler_every(env: Environ) -> int | None:
    """``MANYGPU_STRAGGLERS`` as steps per report: 0 is off, ``None`` when unset."""
    value = get_int(env, STRAGGLERS)
    if value is not None and value < 0:
        raise UsageError(f"{STRAGGLERS}={value} must be 0 (off) or a number of steps per report")
    return value


def restart_count(env: Environ) -> int:
    """How many times torch elastic has restarted this job's workers (0 at first)."""
    return get_int(env, "TORCHELASTIC_RESTART_COUNT") or 0


def gpus_bound_per_task(env: Environ) -> bool:
    """Whether Slurm bound GPUs to each task (``--gpus-per-task``, ``--gpu-bind``): then a
    task sees only its own GPUs (``SLURM_GPUS_PER_TASK``, ``SLURM_GPU_BIND``)."""
    bind = (env.get("SLURM_GPU_BIND") or "").strip().lower()
    return bool(env.get("SLURM_GPUS_PER_TASK")) or (bind not in ("", "none"))


def mlflow_tracking_uri(env: Environ) -> str | None:
    """``MLFLOW_TRACKING_URI``: the MLflow server ``log_with="mlflow"`` writes to."""
    return get_str(env, "MLFLOW_TRACKING_URI")


def mlflow_experiment(env: Environ) -> str | None:
    """``MLFLOW_EXPERIMENT_NAME``: the experiment a new MLflow run goes in."""
    return get_str(env, "MLFLOW_EXPERIMENT_NAME")


def export_worker(*, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Make this (forked) process rank ``rank`` of ``world_size`` on one machine, as
    torchrun's variables say it, so ``Parallel()`` inside it joins the job
    (``manygpu.notebook_launcher``)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
    )
