"""Turn what the user typed (plus Slurm's environment) into a :class:`LaunchSpec`.

Pure functions of their inputs, including the environment and the GPU count,
so every rule is testable without GPUs or a Slurm cluster.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import uuid
from dataclasses import fields
from typing import Any

from manygpu.errors import UsageError
from manygpu.launch import engines
from manygpu.launch.engines import OuterJob
from manygpu.launch.entry import script_problem
from manygpu.launch.netcheck import split_endpoint
from manygpu.launch.spec import (
    AGREED_ID,
    LaunchRequest,
    LaunchSpec,
    ProgramOptions,
    gpu_indices,
    parse_nnodes,
)
from manygpu.runtime import env as envmod
from manygpu.runtime.cluster import DEFAULT_PORT, mpi_port, mpi_ranks, slurm_master
from manygpu.runtime.device import cpu_count, threads_per_process
from manygpu.runtime.env import Environ

CPU_DEFAULT_PROCS = 2
"""Processes started on a machine without GPUs when the user names none."""


def parse_gpus(text: str, env: Environ, cuda_count: int) -> tuple[str, ...]:
    """``"0,2"`` -> the ``CUDA_VISIBLE_DEVICES`` entries for those GPUs.

    Indices refer to the GPUs this process sees, so an outer
    ``CUDA_VISIBLE_DEVICES`` is honoured (index 0 = its first entry).
    """
    indices = gpu_indices(text)
    if indices is None:
        if cuda_count == 0:
            raise UsageError(
                "--gpus all: this machine has no CUDA GPU (check nvidia-smi and the driver); "
                "drop --gpus to run CPU processes"
            )
        return tuple(_visible(env, cuda_count))
    missing = [i for i in indices if i >= cuda_count]
    if missing:
        have = f"GPUs 0..{cuda_count - 1}" if cuda_count else "no CUDA GPU"
        raise UsageError(
            f"--gpus names GPU {missing[0]} but this machine has {have}; "
            "check nvidia-smi, or use --nproc-per-node N for CPU processes"
        )
    visible = _visible(env, cuda_count)
    return tuple(visible[i] for i in indices)


def _visible(env: Environ, cuda_count: int) -> list[str]:
    outer = envmod.visible_devices(env)
    return outer[:cuda_count] if outer is not None else [str(i) for i in range(cuda_count)]


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """``"last_call_timeout=5,read_timeout=60"`` -> a dict (torchrun's format)."""
    conf: dict[str, str] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--rdzv-conf item {item!r} is not KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


def _slurm_nodes(env: Environ) -> tuple[int, int, str, int] | None:
    """(nnodes, node_rank, master_addr, port) when run by srun once per node."""
    if envmod.get_str(env, "SLURM_JOB_ID") is None or envmod.get_str(env, "SLURM_STEP_ID") is None:
        return None
    nnodes = envmod.get_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    ntasks = envmod.get_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or nnodes
    if ntasks > nnodes:
        # Several launchers per node would each run a job of their own, silently. (An
        # allocation of N tasks per node exports SLURM_NTASKS, which overrides a later
        # `srun --ntasks-per-node=1`: srun only warns that it ignores it.)
        raise UsageError(
            f"srun started {ntasks} launchers on {nnodes} node(s); manygpu launch starts "
            "each node's processes itself, so start one per node: srun --ntasks=$SLURM_NNODES "
            "--ntasks-per-node=1 manygpu launch ..., or srun the script itself (one task per GPU)"
        )
    if nnodes <= 1:
        return None
    addr, port = slurm_master(env)
    return nnodes, envmod.get_int(env, "SLURM_NODEID") or 0, addr, port


def _mpi_nodes(env: Environ, master_addr: str | None) -> tuple[int, int, str, int] | None:
    """(nnodes, node_rank, master_addr, port) when mpirun started one launcher per node.

    ``mpirun --map-by ppr:1:node -x MASTER_ADDR=node0 manygpu launch ...``: each
    launcher is one MPI rank, its node's index; the first node serves the store.
    """
    ranks = mpi_ranks(env)
    if ranks is None or ranks[1] <= 1:
        return None
    rank, size, _, local_size = ranks
    if local_size > 1:
        raise UsageError(
            f"mpirun started {local_size} launchers on this node; start one per node "
            "(mpirun --map-by ppr:1:node manygpu launch ...), or run manygpu launch alone"
        )
    addr = master_addr or envmod.get_str(env, "MASTER_ADDR")
    if addr is None:
        raise UsageError(
            f"mpirun started this launcher as node {rank} of {size} but not where node 0 "
            "is: pass -x MASTER_ADDR=<first node> to mpirun, or give --master-addr"
        )
    return size, rank, addr, mpi_port(env)


def outer_job(req: LaunchRequest, env: Environ) -> OuterJob | None:
    """The job an engine started this launcher in, once per node (:mod:`~manygpu.launch.engines`
    first, then Slurm's srun and mpirun); flags given still win over what it says."""
    found = engines.detect(env, req.nnodes, req.master_addr)
    if found is not None:
        return found
    if req.nnodes is not None:
        # A node count given wins; an elastic range under srun still meets where
        # Slurm says (the step's first node, its port), each node with its rank.
        return _slurm_meeting(env) if ":" in req.nnodes else None
    engine, nodes = "Slurm", _slurm_nodes(env)
    if nodes is None:  # only then: mpirun's checks must not fire under srun
        engine, nodes = "mpirun", _mpi_nodes(env, req.master_addr)
    if nodes is None:
        return None
    count, rank, addr, port = nodes
    return OuterJob(engine, count, count, rank, addr, port)


def _slurm_meeting(env: Environ) -> OuterJob | None:
    """Where Slurm's nodes meet, for ``srun manygpu launch --nnodes MIN:MAX``."""
    nodes = _slurm_nodes(env)
    if nodes is None:
        return None
    count, rank, addr, port = nodes
    return OuterJob("Slurm", count, count, rank, addr, port)


def _rendezvous(
    req: LaunchRequest, outer: OuterJob | None, multi: bool, elastic: bool
) -> tuple[str, str, int]:
    """(backend, endpoint, node_rank) for the request."""
    addr = req.master_addr or (outer.master_addr if outer else None)
    port = req.master_port if req.master_port is not None else (outer and outer.master_port)
    node_rank = req.node_rank if req.node_rank is not None else (outer and outer.node_rank) or 0
    if outer is not None and outer.rdzv_endpoint and not req.rdzv_endpoint:
        return outer.rdzv_backend or "c10d", outer.rdzv_endpoint, node_rank
    if elastic and req.rdzv_backend == "static":
        raise UsageError(
            "--nnodes MIN:MAX needs the c10d rendezvous (static waits for MAX nodes); "
            "drop --rdzv-backend static"
        )
    if req.rdzv_endpoint:
        host, rport = split_endpoint(req.rdzv_endpoint, DEFAULT_PORT)
        return req.rdzv_backend or "c10d", _join(host, rport), node_rank
    if multi and addr is None:
        raise UsageError(
            "a job over several nodes needs to know where to meet: give --master-addr "
            "(node 0's address) or --rdzv-endpoint HOST:PORT"
        )
    if addr is None and port is None:
        # One node, nothing given: torchrun --standalone, a free port on loopback.
        return req.rdzv_backend or "c10d", "127.0.0.1:0", 0
    # Fixed node count: torchrun's static rendezvous; a range: c10d, the elastic one.
    backend = req.rdzv_backend or ("c10d" if elastic else "static")
    return backend, _join(addr or "127.0.0.1", port or DEFAULT_PORT), node_rank


def nproc_count(value: int | str, gpus: int) -> int:
    """``--nproc-per-node`` as a count: a number as given, or torchrun's words on
    this node (``auto``: its GPUs, else its CPUs; ``cpu``; ``gpu``)."""
    if isinstance(value, int):
        return value
    if value == "gpu" and gpus == 0:
        raise UsageError("--nproc-per-node gpu: this node has no CUDA GPU; give a number or cpu")
    if value == "gpu" or (value == "auto" and gpus > 0):
        return gpus
    return cpu_count()


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve(req: LaunchRequest, env: Environ, cuda_count: int) -> LaunchSpec:
    """Validate ``req`` and fill in every default; raises ``UsageError`` on bad input."""
    _check_entry(req)
    if req.standalone:
        _check_standalone(req)
    gpus = parse_gpus(req.gpus, env, cuda_count) if req.gpus is not None else None
    if req.nproc_per_node is not None:
        nproc = nproc_count(req.nproc_per_node, len(gpus) if gpus is not None else cuda_count)
    elif gpus is not None:
        nproc = len(gpus)
    else:
        nproc = cuda_count or CPU_DEFAULT_PROCS
    outer = outer_job(req, env)
    if req.nproc_per_node is None and gpus is None and outer and outer.nproc_per_node:
        nproc = outer.nproc_per_node
    if req.nnodes is None and outer is not None:
        min_nodes, max_nodes = outer.min_nodes, outer.max_nodes
    else:
        min_nodes, max_nodes = parse_nnodes(req.nnodes) if req.nnodes is not None else (1, 1)
    backend, endpoint, node_rank = _rendezvous(
        req, outer, multi=max_nodes > 1, elastic=min_nodes != max_nodes
    )
    extra_env = _worker_env(env, nproc, gpus, single_node=max_nodes == 1) | req.worker_env
    return LaunchSpec(
        **_as_given(req),
        nproc_per_node=nproc,
        gpus=gpus,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=node_rank,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_id=req.rdzv_id
        or (outer and outer.rdzv_id)
        or _default_run_id(env, multi_node=max_nodes > 1),
        local_addr=req.local_addr or ("127.0.0.1" if max_nodes == 1 else None),
        rdzv_conf=parse_rdzv_conf(req.rdzv_conf),
        extra_env=extra_env,
        note=outer.note if outer is not None else None,
    )


def _as_given(req: LaunchRequest) -> dict[str, Any]:
    """The options the launcher uses as typed (:class:`ProgramOptions`), by field name."""
    return {f.name: getattr(req, f.name) for f in fields(ProgramOptions)}


def _check_entry(req: LaunchRequest) -> None:
    if req.torchrun.no_python:
        if req.is_module:
            raise UsageError("--no-python and -m cannot be used together (as with torchrun)")
        if not (os.path.isfile(req.entry) or shutil.which(req.entry)):
            raise UsageError(f"program {req.entry!r} not found (--no-python runs it directly)")
        return
    if req.is_module:
        _check_module(req.entry)
    elif (problem := script_problem(req.entry)) is not None:
        raise UsageError(problem)


def _check_module(name: str) -> None:
    """``-m NAME`` must be importable from here (the workers start here, with this path)."""
    top = name.split(".", 1)[0]
    if not top.isidentifier():
        raise UsageError(f"-m {name!r} is not a module name")
    found = importlib.util.find_spec(top) is not None or (
        importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None
    )
    if not found:
        raise UsageError(
            f"module {top!r} not found (-m {name}): run from its project directory, "
            "install it, or add it to PYTHONPATH"
        )


def _check_standalone(req: LaunchRequest) -> None:
    """torchrun --standalone: one node, a private rendezvous on loopback (our default)."""
    if req.nnodes not in (None, "1", "1:1"):
        raise UsageError(f"--standalone runs one node; drop --nnodes {req.nnodes} or --standalone")
    given = [
        flag
        for flag, value in (
            ("--master-addr", req.master_addr),
            ("--rdzv-endpoint", req.rdzv_endpoint),
        )
        if value
    ]
    if given:
        raise UsageError(f"--standalone picks its own rendezvous; drop {given[0]}")


def _default_run_id(env: Environ, multi_node: bool) -> str:
    """A fresh, random id per job, the same on every node.

    One node draws it here. Nodes started one by one cannot draw it alike, so
    the store's host draws it and the others read it at the rendezvous
    (:data:`~manygpu.launch.spec.AGREED_ID`); under Slurm the job id.
    """
    slurm_job = envmod.get_str(env, "SLURM_JOB_ID")
    if slurm_job:
        return slurm_job
    return AGREED_ID if multi_node else f"manygpu-{uuid.uuid4().hex[:16]}"


def threads_note(spec: LaunchSpec) -> str | None:
    """Said once at launch when we chose the workers' thread count (torchrun says it
    too): a silent OMP_NUM_THREADS=1 otherwise reads as a slow CPU. ``None`` when the
    user set the variable (theirs passes through untouched)."""
    threads = spec.extra_env.get("OMP_NUM_THREADS")
    if threads is None:
        return None
    n = spec.nproc_per_node
    workers = "the 1 worker" if n == 1 else f"each of the {n} workers"
    return (
        f"OMP_NUM_THREADS={threads} for {workers} on this node ({cpu_count()} CPUs split "
        "among them); set OMP_NUM_THREADS to choose"
    )


def _worker_env(
    env: Environ, nproc: int, gpus: tuple[str, ...] | None, single_node: bool
) -> dict[str, str]:
    """Variables the workers need on top of the agent's."""
    extra: dict[str, str] = {}
    if gpus is not None:
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if not envmod.user_set_threads(env):
        extra["OMP_NUM_THREADS"] = str(threads_per_process(nproc))
    if single_node and "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        # All ranks are local: keep gloo off interfaces the hostname resolves to.
        extra["GLOO_SOCKET_IFNAME"] = "lo"
    return extra
