"""Cluster engines that start one ``manygpu launch`` per node -> one job over those nodes.

Each table row is what an engine really sets (Kubeflow Trainer v2, training-operator v1
before and after 1.7, JobSet, SkyPilot), read by :mod:`manygpu.launch.engines` and then
through ``resolve()``. Pure: plain dicts, no GPUs, no cluster.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from manygpu.errors import UsageError
from manygpu.launch import engines
from manygpu.launch.resolve import CPU_DEFAULT_PROCS, LaunchRequest, resolve
from manygpu.launch.spec import AGREED_ID, LaunchSpec

K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
TRAINER_V2 = K8S | {  # torch plugin of Trainer v2: PET_* only, node rank = completion index
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "auto",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "tj-node-0-0.tj",
    "PET_MASTER_PORT": "29500",
    "JOB_COMPLETION_INDEX": "1",
}
V1_NEW = K8S | {  # training-operator v1 >= 1.7, worker-1: WORLD_SIZE = 3 pods x 4 procs
    "MASTER_ADDR": "pj-master-0",
    "MASTER_PORT": "23456",
    "RANK": "2",
    "WORLD_SIZE": "12",
    "PET_MASTER_ADDR": "pj-master-0",
    "PET_MASTER_PORT": "23456",
    "PET_NODE_RANK": "2",
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "4",
}
V1_ELASTIC = K8S | {
    "PET_RDZV_BACKEND": "c10d",
    "PET_RDZV_ENDPOINT": "pj-worker-0:23456",
    "PET_RDZV_ID": "pj",
    "PET_NNODES": "1:4",
    "PET_NPROC_PER_NODE": "2",
}
V1_OLD = K8S | {  # before 1.7: WORLD_SIZE counts pods, RANK is the pod index
    "MASTER_ADDR": "pj-master-0",
    "MASTER_PORT": "23456",
    "RANK": "1",
    "WORLD_SIZE": "3",
}
JOBSET = K8S | {"JOB_COMPLETION_INDEX": "2"}
SKY = {
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7",
    "SKYPILOT_NUM_NODES": "3",
    "SKYPILOT_NUM_GPUS_PER_NODE": "8",
}
SLURM = {
    "SLURM_JOB_ID": "98765",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}
SLURM_PORT = 20000 + zlib.crc32(b"98765.0") % 10000  # job.step
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29555",
}

# id, env, cuda_count, request flags, engine (None: no engine), expected spec as
# (min_nodes, max_nodes, node_rank, rdzv_backend, rdzv_endpoint, nproc), words of the note.
CASES = [
    ("trainer-auto-cpu", TRAINER_V2, 0, {}, "Kubeflow Trainer",
     (3, 3, 1, "static", "tj-node-0-0.tj:29500", CPU_DEFAULT_PROCS), None),
    ("trainer-auto-gpu", TRAINER_V2, 4, {}, "Kubeflow Trainer",
     (3, 3, 1, "static", "tj-node-0-0.tj:29500", 4), None),
    ("trainer-int-nproc", TRAINER_V2 | {"PET_NPROC_PER_NODE": "2"}, 4, {}, "Kubeflow Trainer",
     (3, 3, 1, "static", "tj-node-0-0.tj:29500", 2), None),
    ("trainer-one-node", TRAINER_V2 | {"PET_NNODES": "1", "PET_NODE_RANK": "0"}, 1, {},
     "Kubeflow Trainer", (1, 1, 0, "c10d", "127.0.0.1:0", 1), None),
    ("v1-new", V1_NEW, 4, {}, "training-operator v1",
     (3, 3, 2, "static", "pj-master-0:23456", 4), ["WORLD_SIZE=12", "RANK=2", "PET_*"]),
    ("v1-elastic", V1_ELASTIC, 0, {}, "Kubeflow",
     (1, 4, 0, "c10d", "pj-worker-0:23456", 2), None),
    ("v1-old", V1_OLD, 2, {}, "Kubeflow PyTorchJob",
     (3, 3, 1, "static", "pj-master-0:23456", 2), ["WORLD_SIZE=3 counts pods", "pod 1 of 3"]),
    ("v1-old-default-port", {k: v for k, v in V1_OLD.items() if k != "MASTER_PORT"}, 0, {},
     "Kubeflow PyTorchJob", (3, 3, 1, "static", "pj-master-0:23456", 2), ["WORLD_SIZE=3"]),
    ("v1-old-outside-k8s", {k: v for k, v in V1_OLD.items() if k not in K8S}, 0, {}, None,
     (1, 1, 0, "c10d", "127.0.0.1:0", 2), None),
    ("v1-old-under-torchrun", V1_OLD | {"TORCHELASTIC_RUN_ID": "none"}, 0, {}, None,
     (1, 1, 0, "c10d", "127.0.0.1:0", 2), None),
    ("jobset-flags", JOBSET, 0, {"nnodes": "4", "master_addr": "js-0"}, "JobSet",
     (4, 4, 2, "static", "js-0:29500", 2), None),
    ("jobset-env", JOBSET | {"NNODES": "4", "MASTER_ADDR": "js-0", "MASTER_PORT": "29400"}, 0,
     {}, "JobSet", (4, 4, 2, "static", "js-0:29400", 2), None),
    ("skypilot", SKY, 8, {}, "SkyPilot", (3, 3, 1, "static", "10.0.0.5:29500", 8), None),
    ("skypilot-cpu", SKY | {"SKYPILOT_NUM_GPUS_PER_NODE": "0"}, 0, {}, "SkyPilot",
     (3, 3, 1, "static", "10.0.0.5:29500", CPU_DEFAULT_PROCS), None),
    ("flags-win-kubeflow", TRAINER_V2, 4,
     {"nnodes": "2", "master_addr": "h0", "node_rank": 0, "nproc_per_node": 3},
     "Kubeflow Trainer", (2, 2, 0, "static", "h0:29500", 3), None),
    ("flags-win-v1-old", V1_OLD, 0, {"node_rank": 2, "master_addr": "h1", "master_port": 7000},
     "Kubeflow PyTorchJob", (3, 3, 2, "static", "h1:7000", 2), ["WORLD_SIZE=3"]),
    ("flags-win-skypilot", SKY, 8, {"nnodes": "4", "node_rank": 3, "nproc_per_node": 1},
     "SkyPilot", (4, 4, 3, "static", "10.0.0.5:29500", 1), None),
    ("kubeflow-over-slurm-and-sky", TRAINER_V2 | SLURM | SKY, 0, {}, "Kubeflow Trainer",
     (3, 3, 1, "static", "tj-node-0-0.tj:29500", CPU_DEFAULT_PROCS), None),
    ("skypilot-over-slurm", SKY | SLURM, 8, {}, "SkyPilot",
     (3, 3, 1, "static", "10.0.0.5:29500", 8), None),
    ("plain-pod", K8S, 0, {}, None, (1, 1, 0, "c10d", "127.0.0.1:0", 2), None),
    ("slurm-unchanged", SLURM, 0, {}, None,
     (2, 2, 1, "static", f"gpu07:{SLURM_PORT}", 2), None),
    ("mpirun-unchanged", OPEN_MPI, 0, {}, None, (3, 3, 1, "static", "node0:29555", 2), None),
]  # fmt: skip
IDS = [case[0] for case in CASES]


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def _resolve(script: str, env: dict[str, str], cuda: int = 0, **kw: object) -> LaunchSpec:
    return resolve(LaunchRequest(entry=script, **kw), env, cuda)  # type: ignore[arg-type]


def _detect(env: dict[str, str], **kw: object) -> engines.OuterJob | None:
    nnodes, addr = kw.get("nnodes"), kw.get("master_addr")
    return engines.detect(env, nnodes, addr)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "env", "cuda", "kw", "engine", "want", "note"), CASES, ids=IDS)
def test_engine_table_through_detect_and_resolve(
    script: str,
    name: str,
    env: dict[str, str],
    cuda: int,
    kw: dict[str, object],
    engine: str | None,
    want: tuple[object, ...],
    note: list[str] | None,
) -> None:
    found = _detect(env, **kw)
    if engine is None:
        assert found is None
    else:
        assert found is not None and engine in found.engine
    spec = _resolve(script, env, cuda, **kw)
    got = (spec.min_nodes, spec.max_nodes, spec.node_rank, spec.rdzv_backend, spec.rdzv_endpoint)
    assert (*got, spec.nproc_per_node) == want
    if note is None:
        assert spec.note is None
    else:
        assert spec.note is not None and "\n" not in spec.note
        assert all(word in spec.note for word in note), spec.note


@pytest.mark.parametrize(
    ("env", "rdzv_id"),
    [(TRAINER_V2, AGREED_ID), (V1_ELASTIC, "pj"), (SKY | SLURM, "98765")],
    ids=["trainer-agreed", "v1-elastic-pet-rdzv-id", "skypilot-on-slurm-job-id"],
)
def test_run_id_is_the_same_on_every_node(script: str, env: dict[str, str], rdzv_id: str) -> None:
    assert _resolve(script, env).rdzv_id == rdzv_id


def test_per_engine_functions() -> None:
    trainer = engines.kubeflow(TRAINER_V2)
    assert trainer is not None and trainer.engine == "Kubeflow Trainer"
    assert (trainer.min_nodes, trainer.max_nodes, trainer.node_rank) == (3, 3, 1)
    assert (trainer.master_addr, trainer.master_port, trainer.nproc_per_node) == (
        "tj-node-0-0.tj", 29500, None)  # fmt: skip
    assert trainer.note is None
    new = engines.kubeflow(V1_NEW)
    assert new is not None and "v1" in new.engine and new.note is not None
    assert (new.max_nodes, new.node_rank, new.master_port, new.nproc_per_node) == (3, 2, 23456, 4)
    elastic = engines.kubeflow(V1_ELASTIC)
    assert elastic is not None and elastic.node_rank is None  # the rendezvous assigns it
    assert (elastic.min_nodes, elastic.max_nodes, elastic.rdzv_backend) == (1, 4, "c10d")
    assert (elastic.rdzv_endpoint, elastic.rdzv_id) == ("pj-worker-0:23456", "pj")
    assert (elastic.master_addr, elastic.master_port) == ("pj-worker-0", 23456)
    old = engines.pytorchjob_v1(V1_OLD)
    assert old is not None and (old.max_nodes, old.node_rank, old.master_port) == (3, 1, 23456)
    assert engines.kubeflow(V1_OLD) is None and engines.pytorchjob_v1(K8S) is None
    # v1 >= 1.7 also sets MASTER_ADDR/RANK/WORLD_SIZE, but PET_* is read first.
    assert engines.detect(V1_NEW, None, None) == new
    js = engines.jobset(JOBSET, "4", "js-0")
    assert js is not None and (js.max_nodes, js.node_rank, js.master_addr) == (4, 2, "js-0")
    assert engines.jobset(K8S, "4", "js-0") is None
    sky = engines.skypilot(SKY)
    assert sky is not None and (sky.max_nodes, sky.node_rank, sky.master_addr) == (3, 1, "10.0.0.5")
    assert sky.nproc_per_node == 8
    no_gpu = engines.skypilot(SKY | {"SKYPILOT_NUM_GPUS_PER_NODE": "0"})
    assert no_gpu is not None and no_gpu.nproc_per_node is None
    assert engines.skypilot(SLURM) is None and engines.detect(SLURM | OPEN_MPI, None, None) is None


# id, env, request flags, words the one-line error must contain.
ERRORS = [
    ("pet-rank-without-nnodes", K8S | {"PET_NODE_RANK": "1"}, {}, ["PET_NNODES"]),
    ("pet-nnodes-without-addr", K8S | {"PET_NNODES": "2", "PET_NODE_RANK": "1"}, {},
     ["PET_MASTER_ADDR", "PET_NNODES=2", "--master-addr"]),
    ("pet-nnodes-without-rank-and-addr", K8S | {"PET_NNODES": "2", "PET_MASTER_PORT": "29500"},
     {}, ["PET_NODE_RANK", "PET_MASTER_ADDR"]),
    ("pet-nnodes-x", TRAINER_V2 | {"PET_NNODES": "x"}, {}, ["PET_NNODES='x'"]),
    ("pet-nnodes-3:1", TRAINER_V2 | {"PET_NNODES": "3:1"}, {}, ["PET_NNODES='3:1'"]),
    ("pet-nproc-negative", TRAINER_V2 | {"PET_NPROC_PER_NODE": "-1"}, {},
     ["PET_NPROC_PER_NODE='-1'"]),
    ("pet-nproc-many", TRAINER_V2 | {"PET_NPROC_PER_NODE": "many"}, {},
     ["PET_NPROC_PER_NODE='many'"]),
    ("jobset-nothing", JOBSET, {}, ["NNODES", "MASTER_ADDR", "--nnodes", "--master-addr"]),
    ("jobset-nnodes-only", JOBSET | {"NNODES": "4"}, {}, ["MASTER_ADDR", "--master-addr"]),
    ("jobset-addr-only", JOBSET, {"master_addr": "js-0"}, ["NNODES", "--nnodes"]),
    ("sky-count-vs-ips", SKY | {"SKYPILOT_NUM_NODES": "2"}, {},
     ["SKYPILOT_NUM_NODES=2", "3 SKYPILOT_NODE_IPS"]),
    ("sky-rank-past-ips", SKY | {"SKYPILOT_NODE_RANK": "3"}, {}, ["SKYPILOT_NODE_RANK=3"]),
    ("sky-rank-without-ips", {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2"}, {},
     ["SKYPILOT_NODE_IPS"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "env", "kw", "words"), ERRORS, ids=[e[0] for e in ERRORS])
def test_partial_or_bad_engine_environment_is_one_line_error(
    script: str, name: str, env: dict[str, str], kw: dict[str, object], words: list[str]
) -> None:
    for attempt in (lambda: _detect(env, **kw), lambda: _resolve(script, env, 0, **kw)):
        with pytest.raises(UsageError) as err:
            attempt()
        message = str(err.value)
        assert "\n" not in message
        assert all(word in message for word in words), message


def test_jobset_missing_names_only_what_is_missing() -> None:
    with pytest.raises(UsageError) as err:
        engines.jobset(JOBSET | {"NNODES": "4"}, None, None)
    assert "did not set MASTER_ADDR (--master-addr)" in str(err.value)
    assert "NNODES (--nnodes):" not in str(err.value)


@pytest.mark.parametrize("kw", [{"nnodes": "1"}, {"nnodes": "1", "master_addr": "js-0"}])
def test_indexed_job_pod_with_nnodes_1_is_one_node(script: str, kw: dict[str, object]) -> None:
    # An Indexed Job used as a sweep: each pod its own one-node job, pod 3 here.
    spec = _resolve(script, K8S | {"JOB_COMPLETION_INDEX": "3"}, 0, **kw)
    assert (spec.max_nodes, spec.node_rank) == (1, 0)


def test_a_one_node_engine_job_meets_privately_on_loopback(script: str) -> None:
    """One node needs no shared address: a free loopback port, as without an engine
    (a fixed port would clash with a second launch on the same node)."""
    sky = {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "10.0.0.5", "SKYPILOT_NUM_NODES": "1"}
    for env in (sky, TRAINER_V2 | {"PET_NNODES": "1", "PET_NODE_RANK": "0"}):
        spec = _resolve(script, env, 0)
        assert (spec.max_nodes, spec.rdzv_endpoint, spec.node_rank) == (1, "127.0.0.1:0", 0)
