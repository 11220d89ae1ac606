"""A real Ray cluster of two emulated hosts runs a manygpu training loop under Ray Train.

``ray start --head`` on host 0 and ``ray start --address`` on host 1 (2 CPUs
each, their own temp dirs, torn down with nothing left); a driver on host 0
runs a ``TorchTrainer`` of 2 hosts x 2 workers. ``Parallel`` adopts Ray's group
(gloo over the hosts' network); the recipe's GPT (ModuleList blocks, tied head,
AdamW groups, warmup + cosine, clipping, 22 samples) trains under ddp and fsdp,
every parameter within AdamW's 1e-4 of one plain process on the global batch.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from jobs import subprocess_env
from recipes import Recipe, max_diff, reference_train

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

pytest.importorskip("ray", reason="Ray Train is not installed (pip install 'manygpu[ray]')")
OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

RAY = str(Path(sys.executable).with_name("ray"))
DRIVER = Path(__file__).parent / "scripts" / "ray_driver.py"
ADAM_TOL = 1e-4  # AdamW's tolerance, as in tests/distributed/test_real_models.py
STRATEGIES = ("ddp", "fsdp")
TOKEN = secrets.token_hex(32)


def _env() -> dict[str, str]:
    """Every Ray process of the cluster (nodes, driver) holds the cluster's token, in its
    environment (never on a command line): a host without it cannot join."""
    return subprocess_env(namespace=True) | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}


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
        "2",
        "--disable-usage-stats",
        "--temp-dir",
        str(tmp / f"ray{host}"),
    ]
    if host == 0:
        argv += ["--include-dashboard", "false"]
    log = open(tmp / f"ray-node{host}.log", "w")  # noqa: SIM115  (closed with the process)
    return cluster.popen(host, argv, stdout=log, stderr=subprocess.STDOUT,
                         env=_env(), start_new_session=True)  # fmt: skip


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatedCluster, Path]]:
    tmp = tmp_path_factory.mktemp("ray")
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        nodes = [_ray_node(cluster, 0, tmp)]
        try:
            _wait_for_nodes(cluster, 1, tmp)
            nodes.append(_ray_node(cluster, 1, tmp))
            _wait_for_nodes(cluster, 2, tmp)
            yield cluster, tmp
        finally:
            for node in nodes:
                node.terminate()  # ray start --block stops its node's processes on SIGTERM
            for node in nodes:
                try:
                    node.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    node.kill()
            shutil.rmtree(tmp, ignore_errors=True)


def _wait_for_nodes(
    cluster: EmulatedCluster, count: int, tmp: Path, timeout_s: float = 120
) -> None:
    head = f"{cluster.addresses[0]}:6379"
    deadline, said = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        res = subprocess.run(
            cluster.command(0, [sys.executable, "-c", _COUNT_NODES, head]),
            capture_output=True, text=True, env=_env(), timeout=60,
        )  # fmt: skip
        if res.returncode == 0 and res.stdout.strip() == str(count):
            return
        said = res.stdout[-1000:] + res.stderr[-2000:]
        time.sleep(2)
    logs = "\n".join(p.read_text()[-2000:] for p in tmp.glob("ray-node*.log"))
    pytest.fail(f"the Ray cluster did not reach {count} node(s) in {timeout_s}s:\n{said}\n{logs}")


_COUNT_NODES = (
    "import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
    "print(sum(n['Alive'] for n in ray.nodes()))"
)


@pytest.mark.timeout(600)
def test_ray_train_over_two_hosts_matches_one_process(
    ray_hosts: tuple[EmulatedCluster, Path], tmp_path: Path
) -> None:
    cluster, _ = ray_hosts
    argv = [sys.executable, str(DRIVER), f"{cluster.addresses[0]}:6379", str(tmp_path),
            ",".join(STRATEGIES)]  # fmt: skip
    res = subprocess.run(
        cluster.command(0, argv), capture_output=True, text=True,
        env=_env(), timeout=420,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-4000:]
    ref = reference_train(Recipe("gpt"), data_world=4)["params"]
    for strategy in STRATEGIES:
        records = [torch.load(tmp_path / f"{strategy}-rank{r}.pt", weights_only=True)
                   for r in range(4)]  # fmt: skip
        assert {rec["ip"] for rec in records} == set(cluster.addresses[:2]), records
        for rank, rec in enumerate(records):
            assert rec["error"] is None and rec["world"] == 4, (strategy, rank, rec["error"])
            assert rec["data_world"] == 4
            assert max_diff(rec["params"], ref) < ADAM_TOL, (strategy, rank)
