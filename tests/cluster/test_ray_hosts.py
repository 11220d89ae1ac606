"""A real Ray cluster of two emulated hosts runs manygpu training loops under Ray Train.

``ray start --head`` on host 0 and ``ray start --address`` on host 1 (1 CPU
each, their own temp dirs, a token every node holds, no log monitor: the
driver takes no worker logs; torn down with nothing left); one driver on host
0 (tests/cluster/scripts/ray_driver.py) runs one job of 2 hosts x 1 worker,
``Parallel`` adopting Ray's group (gloo over the hosts' network), whose three
attempts check, in turn:
- the recipe's GPT (ModuleList blocks, tied head, AdamW groups, warmup +
  cosine, clipping, 22 samples) under ddp and fsdp, on the first attempt before
  its job: every parameter within AdamW's 1e-4 of one plain process on the
  global batch;
- ``manygpu.ray.run`` of the recipe under fsdp with asynchronous checkpoints
  every 2 steps: the last worker dies after step 5, Ray restarts the group
  (``max_failures=2``), ``resume()`` continues from the last committed step,
  and the parameters after step 6 are bit-identical to an uninterrupted run's;
- the same job elastic, ``num_workers=(1, 2)``: after step 7 of that second
  attempt host 1's Ray node stops; Ray restarts the group with the worker
  host 0 holds, the Checkpointer resumes the 2 ranks' step on 1 (resharded),
  and the job ends within AdamW's 1e-4 of the uninterrupted 2-rank run (the
  same global batch of 8: the math is the same, the reduction order is not);
  Ray's ``Result`` points to the last step and holds ``par.log``'s loss. Ray's
  view of the cluster lags the lost node, so its controller first asks for 2
  workers again and waits 15 s for them
  (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``) before it starts 1.
Before the driver, ``manygpu doctor --ray`` reports both nodes.

Every Ray process costs CPU (the suite runs on 2 cores): a Ray Train worker
~6 CPU-s, each of Ray Train's helper actors 2-4. So one job, not three (each
job starts its own controller and actors: three jobs, 41 Ray worker processes,
289 CPU-s; one job of 2 x 2 workers, 23 processes, 136 CPU-s), one worker per
host (what is lost is a host, whatever its worker count; a group spread over
hosts, and a resharded resume, need no second worker per host), and what the
checks never use is off, by Ray's own settings: no workers prestarted for the
first driver (``RAY_prestart_worker_first_driver=0``), no preemption watcher
(``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``: nothing is drained here), no
metrics (``RAY_TRAIN_METRICS_ENABLED=0``, ``RAY_enable_metrics_collection=0``),
no log monitor.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from jobs import subprocess_env
from ray_job import train
from recipes import Recipe, max_diff, reference_train

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available
from manygpu.runtime.ray_train import RAY_VERSION

pytest.importorskip("ray", reason="Ray Train is not installed (pip install 'manygpu[ray]')")
OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

RAY = str(Path(sys.executable).with_name("ray"))
DRIVER = Path(__file__).parent / "scripts" / "ray_driver.py"
ADAM_TOL = 1e-4  # AdamW's tolerance, as in tests/distributed/test_real_models.py
STRATEGIES = ("ddp", "fsdp")
TOTAL, SNAPSHOT_AT = 8, 6  # the job's steps, and the step its second attempt saves (ray_driver.py)
DATA = {"samples": 24, "global_batch": 8}  # its data too
TOKEN = secrets.token_hex(32)
STOP_S = 5
"""How long Ray's nodes get to stop on SIGTERM before their hosts' processes are killed
(Ray's own stop took ~30 s, most of it waiting on a host already gone)."""


LEAN = {
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}
"""Ray's settings that turn off what no check here uses (see the module docstring)."""


def _env() -> dict[str, str]:
    """Every Ray process of the cluster (nodes, driver) holds the cluster's token, in its
    environment (never on a command line): a host without it cannot join."""
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    return subprocess_env(namespace=True) | token | LEAN


def _ray_node(cluster: EmulatedCluster, host: int, tmp: Path) -> subprocess.Popen[str]:
    head = cluster.addresses[0]
    where = ["--head", "--port", "6379"] if host == 0 else ["--address", f"{head}:6379"]
    argv = [
        RAY,
        "start",
        "--block",
        *where,
        "--node-ip-address",
        cluster.addresses[host],
        "--num-cpus",
        "1",  # one worker per host: Ray Train packs its workers onto as few nodes as fit
        "--disable-usage-stats",
        "--include-log-monitor",  # it sends worker logs to drivers; ours takes none
        "false",
        "--temp-dir",
        str(tmp / f"ray{host}"),
    ]
    if host == 0:
        argv += ["--include-dashboard", "false"]
    log = open(tmp / f"ray-node{host}.log", "w")  # noqa: SIM115  (closed with the process)
    return cluster.popen(host, argv, stdout=log, stderr=subprocess.STDOUT,
                         env=_env(), start_new_session=True)  # fmt: skip


@pytest.fixture(scope="module")
def ray_hosts() -> Iterator[tuple[EmulatedCluster, Path, int]]:
    """The cluster, its temp dir, and the pid of host 1's node (the elastic job stops it)."""
    # A short directory: Ray's sockets live under its temp dir, and a Unix socket's path
    # holds at most 107 bytes (pytest's per-worker directories run past it).
    tmp = Path(tempfile.mkdtemp(prefix="mg-ray-"))
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        nodes = [_ray_node(cluster, 0, tmp)]
        try:
            _wait_started(nodes[0], 0, tmp)
            nodes.append(_ray_node(cluster, 1, tmp))
            _wait_started(nodes[1], 1, tmp)
            yield cluster, tmp, nodes[1].pid
        finally:
            for node in nodes:
                node.terminate()  # ray start --block stops its node's processes on SIGTERM
            deadline = time.monotonic() + STOP_S
            for host, node in enumerate(nodes):
                try:
                    node.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    cluster.kill_host(host)  # what Ray is still stopping: every process there
                    node.wait(timeout=30)
            shutil.rmtree(tmp, ignore_errors=True)


def _wait_started(
    node: subprocess.Popen[str], host: int, tmp: Path, timeout_s: float = 120
) -> None:
    """Until the node's ``ray start`` says it started, which it says once the GCS lists the
    node (Ray's ``Node`` waits for that): read from its log, where a probe would cost a
    Ray driver process per try."""
    log, deadline = tmp / f"ray-node{host}.log", time.monotonic() + timeout_s
    while "Ray runtime started." not in log.read_text(errors="replace"):
        if node.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"Ray's node {host} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def driven(ray_hosts: tuple[EmulatedCluster, Path, int]) -> tuple[EmulatedCluster, Path]:
    """``manygpu doctor --ray`` on host 0 (its JSON in OUT/doctor.json), then the job,
    run by one driver on host 0 (its last fault stops host 1's node); OUT."""
    cluster, tmp, node1 = ray_hosts
    out, head = tmp / "out", f"{cluster.addresses[0]}:6379"
    out.mkdir()
    doctor = [sys.executable, "-m", "manygpu", "doctor", "--ray", head, "--json", "--quiet",
              "--op-timeout", "60"]  # fmt: skip
    res = subprocess.run(
        cluster.command(0, doctor), capture_output=True, text=True, env=_env(), timeout=120
    )
    (out / "doctor.json").write_text(res.stdout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    argv = [sys.executable, str(DRIVER), head, str(out), str(node1), cluster.addresses[1]]
    res = subprocess.run(
        cluster.command(0, argv), capture_output=True, text=True, env=_env(), timeout=560
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-4000:]
    return cluster, out


@pytest.fixture(scope="module")
def reference(
    driven: tuple[EmulatedCluster, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, torch.Tensor]]:
    """The job's run, uninterrupted, on 2 ranks (after the cluster's work: the two never
    share the 2 cores): its parameters at the end and after step SNAPSHOT_AT."""
    tmp = tmp_path_factory.mktemp("ray-reference")
    config = {"out": str(tmp), "ckpt": str(tmp / "ck"), "total": TOTAL, "strategy": "fsdp",
              "snapshot_at": SNAPSHOT_AT, **DATA}  # fmt: skip
    end = run_ranks(train, 2, config, extra_env={"OMP_NUM_THREADS": "1"}, timeout=240)[0]
    return {"end": end, "snapshot": torch.load(tmp / "snapshot-from-0-world-2.pt")}


@pytest.mark.timeout(600)
def test_doctor_reports_the_ray_clusters_nodes(driven: tuple[EmulatedCluster, Path]) -> None:
    cluster, out = driven
    report = json.loads((out / "doctor.json").read_text())
    head = f"{cluster.addresses[0]}:6379"
    assert report["status"] == "ok", report["checks"]
    said = report["checks"][0]["message"]
    assert said.startswith(f"2 node(s) alive at {head}: 2 CPUs, 0 GPUs (no GPU"), said
    nodes = report["ray"]["nodes"]
    assert sorted(n["ip"] for n in nodes) == sorted(cluster.addresses[:2]), nodes
    assert [n["head"] for n in nodes if n["ip"] == cluster.addresses[0]] == [True]
    for node in nodes:
        assert node["alive"] and node["cpus"] == 1 and node["gpus"] == 0, node
        assert node["memory_bytes"] > 0, node
        assert node["software"]["ray"] == RAY_VERSION and node["software"]["train_error"] is None


@pytest.mark.timeout(600)
def test_ray_train_over_two_hosts_matches_one_process(
    driven: tuple[EmulatedCluster, Path],
) -> None:
    cluster, out = driven
    ref = reference_train(Recipe("gpt"), data_world=2)["params"]
    for strategy in STRATEGIES:
        records = [torch.load(out / "equal" / f"{strategy}-rank{r}.pt", weights_only=True)
                   for r in range(2)]  # fmt: skip
        assert {rec["ip"] for rec in records} == set(cluster.addresses[:2]), records
        for rank, rec in enumerate(records):
            assert rec["error"] is None and rec["world"] == 2, (strategy, rank, rec["error"])
            assert rec["data_world"] == 2
            assert max_diff(rec["params"], ref) < ADAM_TOL, (strategy, rank)


@pytest.mark.timeout(600)
def test_a_dead_worker_restarts_the_group_which_resumes_bitwise_and_ray_sees_the_steps(
    driven: tuple[EmulatedCluster, Path], reference: dict[str, dict[str, torch.Tensor]]
) -> None:
    _, where = driven
    result = json.loads((where / "result.json").read_text())
    assert result["error"] is None, result["error"]
    assert (where / "killed").exists(), "no worker died: the restart was not tested"
    # The second attempt (2 workers, resumed) saved its parameters after step 6. The
    # asynchronous save of step 4 may still have been uploading when the worker died
    # (never committed): then the group resumed from step 2, as right.
    snapshots = sorted(p.name for p in where.glob("snapshot-from-*-world-2.pt"))
    assert snapshots in (["snapshot-from-2-world-2.pt"], ["snapshot-from-4-world-2.pt"]), snapshots
    params = torch.load(where / snapshots[0], weights_only=True)
    want = reference["snapshot"]
    assert all(torch.equal(params[k], want[k]) for k in want), "not bitwise"
    # Ray keeps a pointer to the step (Ray's form for a checkpoint kept elsewhere).
    assert result["checkpoint"] == str(where / "ck" / f"step-{TOTAL:08d}"), result
    assert result["metrics"]["step"] == TOTAL and "loss" in result["metrics"], result
    said = (where / "said.txt").read_text()
    assert said.count("manygpu: under Ray Train: Ray started the workers") == 1, said


@pytest.mark.timeout(600)
def test_an_elastic_group_that_loses_a_host_resumes_on_the_smaller_world(
    driven: tuple[EmulatedCluster, Path], reference: dict[str, dict[str, torch.Tensor]]
) -> None:
    _, where = driven
    result = json.loads((where / "result.json").read_text())
    assert result["error"] is None, result["error"]
    assert (where / "host-stopped").exists(), "no host was stopped: elasticity was not tested"
    # The last attempt resumed from step 6, or 4 when the save of 6 was uploading.
    resumed = {p.name for p in where.glob("resumed-from-*")}
    assert len(resumed) == 1 and resumed <= {"resumed-from-4", "resumed-from-6"}, resumed
    assert (where / "world-1").exists(), sorted(p.name for p in where.iterdir())
    said = (where / "said.txt").read_text()
    assert "; world size 2 -> 1" in said, said  # the Checkpointer's resume line
    params = torch.load(where / "params.pt", weights_only=True)
    assert max_diff(params, reference["end"]) < ADAM_TOL, max_diff(params, reference["end"])
    assert result["checkpoint"] == str(where / "ck" / f"step-{TOTAL:08d}"), result
    assert result["metrics"]["step"] == TOTAL and "loss" in result["metrics"], result
