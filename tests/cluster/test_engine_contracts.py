"""Cluster engines by their contract: emulated hosts play the pods (or the nodes) an engine
started, each runs ``manygpu launch SCRIPT`` with no flags and exactly the engine's
environment, and the job over 2 hosts trains as one process would:
the real recipe of tests/helpers/recipes.py (a GPT with a ModuleList of blocks and
a tied head, AdamW groups, warmup + cosine, clipping, uneven data) under ddp and
fsdp, every parameter within 1e-4 of one plain process (AdamW's tolerance, as in
tests/distributed/test_real_models.py).

- Kubeflow Trainer v2 (a TrainJob's torch plugin): ``PET_*`` only, node 0 named by
  its headless-service DNS name (``train-node-0-0.train``), resolved through the
  hosts' ``/etc/hosts`` as the cluster's DNS would; ``PET_NPROC_PER_NODE=1``
  (``auto`` and the other values: tests/unit/test_engines.py). Not run here: the
  job of tests/cluster/test_k8s_pods.py runs under exactly this environment, 2
  pods of one process, the recipe under fsdp, and must equal the same 2 ranks
  run locally bit for bit (a second job of 2 processes would cost ~12 s of CPU).
- Kubeflow PyTorchJob before training-operator 1.7: ``MASTER_ADDR`` (the master
  pod's service name), ``MASTER_PORT``, ``RANK`` = the pod's index and
  ``WORLD_SIZE`` = the number of pods, which must not be read as processes: 2
  processes per pod (the launcher's default on a CPU), so that a misread shows.
- SkyPilot: ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``, ``SKYPILOT_NUM_NODES``,
  and ``SKYPILOT_NUM_GPUS_PER_NODE=1``: one process per node (on the CPU here).

One process per node wherever the count is not the point: each costs ~3 s of CPU.

No API server runs here: what is tested is each operator's environment contract
(the variables it injects, from its source), not the operator. The job's secret
comes from the environment, as a Kubernetes Secret mounted as a variable gives it.
The two jobs run at once on one cluster (different ports).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from jobs import subprocess_env
from recipes import Recipe, max_diff, reference_train

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPT = Path(__file__).parent / "scripts" / "recipe_equivalence.py"
ADAM_TOL = 1e-4
STRATEGIES = ("ddp", "fsdp")
NPROC = {"pytorchjob-v1": 2, "skypilot": 1}
"""Processes per node each engine's environment asks for."""
WORLDS = {2 * nproc for nproc in NPROC.values()}
POD = "10.96.0.1"  # KUBERNETES_SERVICE_HOST: every pod has it


def _pytorchjob_v1(node: int) -> dict[str, str]:
    """What training-operator v1 (< 1.7) injects into pod ``node`` of PyTorchJob ``pj``."""
    return {
        "MASTER_ADDR": "pj-master-0",
        "MASTER_PORT": "23456",
        "RANK": str(node),
        "WORLD_SIZE": "2",
        "PYTHONUNBUFFERED": "0",
        "KUBERNETES_SERVICE_HOST": POD,
    }


def _skypilot(node: int, addresses: list[str]) -> dict[str, str]:
    """What SkyPilot gives node ``node``'s ``run`` commands."""
    return {
        "SKYPILOT_NODE_RANK": str(node),
        "SKYPILOT_NODE_IPS": "\n".join(addresses[:2]),
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "1",
        "MASTER_PORT": "29523",
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, list]]]:
    """engine -> (its output directory, each host's completed launcher)."""
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        cluster.name_hosts({"pj-master-0": 0})
        envs = {
            "pytorchjob-v1": _pytorchjob_v1,
            "skypilot": lambda node: _skypilot(node, cluster.addresses),
        }
        started = {}
        for engine, env_of in envs.items():
            out = tmp_path_factory.mktemp(engine)
            argv = [sys.executable, "-m", "manygpu", "launch", str(SCRIPT), str(out)]
            argv += [",".join(STRATEGIES)]
            procs = [
                cluster.popen(
                    node,
                    argv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=subprocess_env(namespace=True) | env_of(node),
                    start_new_session=True,
                )
                for node in range(2)
            ]
            started[engine] = (out, procs)
        done = {}
        try:
            for engine, (out, procs) in started.items():
                done[engine] = (out, [(p.communicate(timeout=300), p.returncode) for p in procs])
        finally:
            for _, procs in started.values():
                for proc in procs:
                    proc.kill()
        yield done


@pytest.fixture(scope="module")
def references() -> dict[int, dict[str, torch.Tensor]]:
    """World size -> the recipe trained in this process on that many ranks' global batches."""
    return {w: reference_train(Recipe("gpt"), data_world=w)["params"] for w in WORLDS}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("engine", ["pytorchjob-v1", "skypilot"])
def test_no_flags_under_the_engine_trains_as_one_process(
    runs: dict[str, tuple[Path, list]],
    references: dict[int, dict[str, torch.Tensor]],
    engine: str,
) -> None:
    out, hosts = runs[engine]
    for node, ((_, err), code) in enumerate(hosts):
        assert code == 0, f"node {node}:\n{err[-3000:]}"
    nproc = NPROC[engine]
    world = 2 * nproc
    for strategy in STRATEGIES:
        for rank in range(world):
            rec = torch.load(out / f"{strategy}-rank{rank}.pt", weights_only=True)
            assert rec["error"] is None, (strategy, rank, rec["error"])
            assert rec["world"] == world and rec["node"] == rank // nproc, rec
            assert rec["data_world"] == world
            assert max_diff(rec["params"], references[world]) < ADAM_TOL, (strategy, rank)


def test_a_pytorchjob_says_world_size_counts_pods(runs: dict[str, tuple[Path, list]]) -> None:
    _, hosts = runs["pytorchjob-v1"]
    (_, err), _ = hosts[1]
    assert (
        "manygpu: Kubeflow PyTorchJob: WORLD_SIZE=2 counts pods, not processes; "
        "this is pod 1 of 2, each starting its own processes"
    ) in err, err[-2000:]
