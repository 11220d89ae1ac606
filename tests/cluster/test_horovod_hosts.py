"""Horovod-style scripts, only their import line changed, under ``manygpu launch -H``
across 2 emulated hosts (one process each: what crosses the hosts is the point;
each process costs seconds), typed on host 0; host 1 is reached over real ssh
(ssh_hosts.py).

``train_mnist_style.py`` draws different initial weights on every rank; its
``broadcast_parameters`` / ``broadcast_optimizer_state`` from rank 0 must make
the 2 ranks train as one process on the same global batch (2 x the per-rank
batch, the same scaled learning rate). Rank 0's final weights are compared
with that process's; every rank's are compared through the test metrics: each
rank scores its own half of the test set with its own weights and
``hvd.allreduce`` averages the halves, which gives the one process's score
over the whole set only if every rank holds its weights.
Tolerance: max |difference| < 1e-5 (fp32, only the order of the sums differs).

``synthetic_benchmark.py`` must run over both hosts (one process each) and
report images per second.

One cluster and its sshd serve both tests (each spawn costs seconds); each
test ends with no process left in either host but sshd.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from jobs import subprocess_env
from ssh_hosts import SshHosts, ensure_openssh

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "horovod"
TOL = 1e-5


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[EmulatedCluster, SshHosts]]:
    """Two emulated hosts at 1 Gbit/s; host 1 runs sshd (the module's tests share them)."""
    why = ensure_openssh()
    if why is not None:
        pytest.skip(why)
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as hosts, SshHosts(hosts) as ssh:
        yield hosts, ssh


@pytest.fixture
def hosts(
    cluster: tuple[EmulatedCluster, SshHosts],
) -> Iterator[tuple[EmulatedCluster, SshHosts]]:
    """The shared hosts; after the test, nothing of its job is left on either."""
    yield cluster
    left = cluster[1].wait_until_clean([0, 1])
    assert left == {}, f"processes left behind: {left}"


def _launch_on_hosts(
    hosts: tuple[EmulatedCluster, SshHosts], slots: int, script: str, args: list[str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """``manygpu launch -H a:SLOTS,b:SLOTS SCRIPT ARGS`` typed on host 0, run to its end."""
    cluster, ssh = hosts
    listed = ",".join(f"{addr}:{slots}" for addr in cluster.addresses)
    argv = [sys.executable, "-m", "manygpu", "launch", "-H", listed,
            "--ssh-config", str(ssh.config), "--timeout", "60", script, *args]  # fmt: skip
    return subprocess.run(
        cluster.command(0, argv),
        capture_output=True,
        text=True,
        env=subprocess_env(namespace=True),
        cwd=cwd,
        timeout=200,
    )


@pytest.mark.timeout(300)
def test_mnist_recipe_from_different_weights_equals_one_process(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    script = str(EXAMPLES / "train_mnist_style.py")
    small = ["--epochs", "2", "--train-size", "256", "--test-size", "128", "--batch-size", "16"]
    two = _launch_on_hosts(
        hosts, 1, script, [*small, "--save", "two.pt", "--metrics", "two.json"], tmp_path
    )
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "Test set: Average loss" in two.stdout
    # One process, the same global batch (2 x 16) at the rate the 2 ranks used (2 x 0.01).
    one_args = [*small, "--batch-size", "32", "--lr", "0.02", "--save", "one.pt"]
    one = subprocess.run(
        [sys.executable, script, *one_args, "--metrics", "one.json"],
        capture_output=True,
        text=True,
        env=subprocess_env() | {"OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
        timeout=200,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    got, want = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).abs().max().item() < TOL, name
    metrics = json.loads((tmp_path / "two.json").read_text())
    alone = json.loads((tmp_path / "one.json").read_text())
    assert metrics["size"] == 2 and alone["size"] == 1
    assert metrics["test_loss"] == pytest.approx(alone["test_loss"], rel=TOL, abs=TOL)
    assert metrics["accuracy"] == pytest.approx(alone["accuracy"], abs=TOL)


@pytest.mark.timeout(300)
def test_synthetic_benchmark_reports_images_per_second_over_hosts(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    res = _launch_on_hosts(
        hosts,
        1,  # one process per host is enough to cross them (each process costs seconds)
        str(EXAMPLES / "synthetic_benchmark.py"),
        ["--model", "resnet_cnn", "--image-size", "32", "--num-classes", "10",
         "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
         "--num-iters", "2", "--json", "bench.json"],
        tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    addr = hosts[0].addresses[0]
    assert f"{addr}/0: Total img/sec on 2 CPU(s)" in res.stdout, res.stdout[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["size"] == 2 and len(result["iters"]) == 2
    assert result["img_sec_total"] > 0
