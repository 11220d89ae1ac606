"""What a cluster engine that started this launcher once per node says about the job.

``manygpu launch train.py`` with no flags must form one job across the nodes an
engine started it on, never an independent one-node job on each. Each engine
says so in its own variables; these pure functions read them (plain mappings,
testable as tables) in this order, the first that recognises its engine wins:

========================  =================================================================
Kubeflow (``PET_*``)      Trainer v2's torch plugin and training-operator v1 >= 1.7:
                          ``PET_NNODES`` (``N``, or ``MIN:MAX`` for v1's elastic policy),
                          ``PET_NODE_RANK``, ``PET_MASTER_ADDR``/``PET_MASTER_PORT``, or
                          ``PET_RDZV_BACKEND``/``PET_RDZV_ENDPOINT``/``PET_RDZV_ID`` (elastic),
                          ``PET_NPROC_PER_NODE``. v1 also sets ``MASTER_ADDR``, ``RANK`` (the
                          pod's index) and ``WORLD_SIZE`` (pods x processes): not read.
PyTorchJob v1 < 1.7       in a pod (``KUBERNETES_SERVICE_HOST``) with ``MASTER_ADDR``,
                          ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and no ``PET_*``:
                          ``WORLD_SIZE`` counts pods and ``RANK`` is the pod's index.
JobSet / indexed Job      ``JOB_COMPLETION_INDEX`` is the node's index; the node count and
                          node 0's address come from ``--nnodes``/``--master-addr`` or
                          ``NNODES``/``MASTER_ADDR`` in the pod spec (JobSet sets neither).
SkyPilot                  ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS`` (one per line, node 0
                          first), ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NUM_GPUS_PER_NODE``.
Slurm, mpirun             :mod:`manygpu.launch.resolve` (``srun`` once per node; ``mpirun
                          --map-by ppr:1:node``).
========================  =================================================================

A partial environment (a rank without a count, a count without an address) is
one error naming the variables, not a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from manygpu.errors import UsageError
from manygpu.launch.spec import parse_nnodes
from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import DEFAULT_PORT
from manygpu.runtime.env import Environ

KUBEFLOW_V1_PORT = 23456
"""training-operator v1's default master port (its ``pytorchjob-port``)."""


@dataclass(frozen=True)
class OuterJob:
    """One job over the nodes an engine started one launcher on each of."""

    engine: str
    min_nodes: int
    max_nodes: int
    node_rank: int | None
    """``None`` for an elastic job: the c10d rendezvous assigns it."""
    master_addr: str | None
    master_port: int | None
    nproc_per_node: int | None = None
    """What the engine asks for; ``None``: manygpu's default (every GPU, or 2 on a CPU)."""
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    note: str | None = None
    """Said once on start, when the engine's variables could be misread."""


def _nproc(text: str | None, name: str) -> int | None:
    """An engine's processes per node: a number, or ``auto``/``gpu``/``cpu`` (our default)."""
    if text is None or text.strip().lower() in ("auto", "gpu", "cpu", ""):
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise UsageError(f"{name}={text!r} is not a number of processes, auto, gpu or cpu")
    return int(text)


def _missing(engine: str, needed: dict[str, str | None]) -> None:
    absent = [name for name, value in needed.items() if value is None]
    if absent:
        have = ", ".join(f"{n}={v}" for n, v in needed.items() if v is not None)
        raise UsageError(
            f"{engine} started this launcher ({have}) but did not set {', '.join(absent)}: "
            "set them in the pod spec, or give --nnodes, --node-rank and --master-addr"
        )


def kubeflow(env: Environ) -> OuterJob | None:
    """Kubeflow's ``PET_*`` variables (Trainer v2, training-operator v1 >= 1.7)."""
    names = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")
    if not any(envmod.get_str(env, n) for n in names):
        return None
    v1 = all(envmod.get_str(env, n) for n in ("MASTER_ADDR", "RANK", "WORLD_SIZE"))
    engine = "Kubeflow PyTorchJob (training-operator v1)" if v1 else "Kubeflow Trainer"
    nnodes = envmod.get_str(env, "PET_NNODES")
    endpoint = envmod.get_str(env, "PET_RDZV_ENDPOINT")
    if nnodes is None:
        raise UsageError(f"{engine} set PET_* variables but not PET_NNODES: set it in the pod spec")
    lo, hi = parse_nnodes(nnodes, f"PET_NNODES={nnodes!r}")
    nproc = _nproc(envmod.get_str(env, "PET_NPROC_PER_NODE"), "PET_NPROC_PER_NODE")
    note = None
    if v1:
        note = (
            f"{engine}: WORLD_SIZE={env['WORLD_SIZE']} and RANK={env['RANK']} count pods "
            "and processes its own way; the job is read from PET_* instead"
        )
    if endpoint is not None:  # v1's elastic policy: c10d, the rank comes from the rendezvous
        host, _, tail = endpoint.rpartition(":")
        return OuterJob(
            engine, lo, hi, None, host or endpoint, int(tail) if tail.isdigit() else None,
            nproc, envmod.get_str(env, "PET_RDZV_BACKEND") or "c10d", endpoint,
            envmod.get_str(env, "PET_RDZV_ID"), note,
        )  # fmt: skip
    rank, addr = envmod.get_str(env, "PET_NODE_RANK"), envmod.get_str(env, "PET_MASTER_ADDR")
    if hi == 1:  # one node: a private rendezvous on loopback, as without an engine
        return OuterJob(engine, 1, 1, 0, None, None, nproc, note=note)
    _missing(engine, {"PET_NNODES": nnodes, "PET_NODE_RANK": rank, "PET_MASTER_ADDR": addr})
    port = envmod.get_int(env, "PET_MASTER_PORT") or DEFAULT_PORT
    node = envmod.get_int(env, "PET_NODE_RANK") or 0
    return OuterJob(engine, lo, hi, node, addr, port, nproc, note=note)


def pytorchjob_v1(env: Environ) -> OuterJob | None:
    """A PyTorchJob of training-operator v1 before 1.7: pod-level ``RANK``/``WORLD_SIZE``."""
    if envmod.get_str(env, "KUBERNETES_SERVICE_HOST") is None:
        return None
    if envmod.get_str(env, "TORCHELASTIC_RUN_ID") is not None:
        return None
    pods, pod = envmod.get_int(env, "WORLD_SIZE"), envmod.get_int(env, "RANK")
    addr = envmod.get_str(env, "MASTER_ADDR")
    if pods is None or pod is None or addr is None:
        return None
    port = envmod.get_int(env, "MASTER_PORT") or KUBEFLOW_V1_PORT
    note = (
        f"Kubeflow PyTorchJob: WORLD_SIZE={pods} counts pods, not processes; "
        f"this is pod {pod} of {pods}, each starting its own processes"
    )
    # Before 1.4 the master pod itself was told MASTER_ADDR=localhost: it serves the store.
    return OuterJob("Kubeflow PyTorchJob", pods, pods, pod, addr, port, note=note)


def jobset(env: Environ, nnodes: str | None, master_addr: str | None) -> OuterJob | None:
    """An indexed Job's pod (JobSet): its index, the rest from flags or the pod spec."""
    index = envmod.get_int(env, "JOB_COMPLETION_INDEX")
    if index is None:
        return None
    count = nnodes or envmod.get_str(env, "NNODES")
    addr = master_addr or envmod.get_str(env, "MASTER_ADDR")
    engine = "an indexed Job (JobSet)"
    bounds = parse_nnodes(count, f"NNODES={count!r}") if count is not None else None
    if bounds == (1, 1):
        return OuterJob(engine, 1, 1, 0, addr, envmod.get_int(env, "MASTER_PORT"))  # a sweep's pod
    _missing(
        engine,
        {"JOB_COMPLETION_INDEX": str(index), "NNODES (--nnodes)": count,
         "MASTER_ADDR (--master-addr)": addr},
    )  # fmt: skip
    assert bounds is not None
    lo, hi = bounds
    if lo != hi:
        return OuterJob(engine, lo, hi, None, addr, envmod.get_int(env, "MASTER_PORT"))
    return OuterJob(engine, lo, hi, index, addr, envmod.get_int(env, "MASTER_PORT"))


def skypilot(env: Environ) -> OuterJob | None:
    """SkyPilot's ``SKYPILOT_*`` variables of a task's ``run`` section."""
    rank, ips = envmod.get_int(env, "SKYPILOT_NODE_RANK"), envmod.get_str(env, "SKYPILOT_NODE_IPS")
    if rank is None:
        return None
    if ips is None:
        raise UsageError("SkyPilot set SKYPILOT_NODE_RANK but not SKYPILOT_NODE_IPS")
    nodes = [line.strip() for line in ips.splitlines() if line.strip()]
    count = envmod.get_int(env, "SKYPILOT_NUM_NODES") or len(nodes)
    if count != len(nodes) or not 0 <= rank < count:
        raise UsageError(
            f"SkyPilot's SKYPILOT_NUM_NODES={count}, SKYPILOT_NODE_RANK={rank} and "
            f"{len(nodes)} SKYPILOT_NODE_IPS disagree"
        )
    gpus = envmod.get_int(env, "SKYPILOT_NUM_GPUS_PER_NODE")
    if count == 1:  # one node: a private rendezvous on loopback, as without an engine
        return OuterJob("SkyPilot", 1, 1, 0, None, None, gpus or None)
    port = envmod.get_int(env, "MASTER_PORT") or DEFAULT_PORT
    return OuterJob("SkyPilot", count, count, rank, nodes[0], port, gpus or None)


def detect(env: Environ, nnodes: str | None, master_addr: str | None) -> OuterJob | None:
    """The first engine (in the module's order, before Slurm and mpirun) that started us."""
    return kubeflow(env) or pytorchjob_v1(env) or jobset(env, nnodes, master_addr) or skypilot(env)
