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

Both scripts run in one launch, one after the other in the same two processes
(scripts/one_after_another.py: each as the launcher runs a script, ``hvd.shutdown()``
between them), on one cluster and its sshd: each start of a process costs seconds of
CPU. The job ends with no process left in either host but sshd.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import subprocess_env
from ssh_hosts import SshHosts, ensure_openssh

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "horovod"
BOTH = Path(__file__).parent / "scripts" / "one_after_another.py"
TOL = 1e-5
SMALL = ["--epochs", "2", "--train-size", "256", "--test-size", "128", "--batch-size", "16"]


@pytest.fixture(scope="module")
def job(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, str, subprocess.CompletedProcess[str]]:
    """Two emulated hosts at 1 Gbit/s (host 1 runs sshd), and one job over them that runs
    the MNIST recipe, then the synthetic benchmark: (its directory, host 0's address,
    the driver's result). Checks nothing of the job is left on either host."""
    why = ensure_openssh()
    if why is not None:
        pytest.skip(why)
    where = tmp_path_factory.mktemp("horovod")
    mnist = [str(EXAMPLES / "train_mnist_style.py"), *SMALL, "--save", "two.pt"]
    mnist += ["--metrics", "two.json"]
    bench = [str(EXAMPLES / "synthetic_benchmark.py"), "--model", "resnet_cnn",
             "--image-size", "32", "--num-classes", "10", "--batch-size", "4",
             "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
             "--json", "bench.json"]  # fmt: skip
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster, SshHosts(cluster) as ssh:
        # One process per host is enough to cross them (each process costs seconds).
        listed = ",".join(f"{addr}:1" for addr in cluster.addresses)
        argv = [sys.executable, "-m", "manygpu", "launch", "-H", listed,
                "--ssh-config", str(ssh.config), "--timeout", "60", str(BOTH),
                *mnist, "--", *bench]  # fmt: skip
        res = subprocess.run(
            cluster.command(0, argv),
            capture_output=True,
            text=True,
            env=subprocess_env(namespace=True),
            cwd=where,
            timeout=300,
        )
        left = ssh.wait_until_clean([0, 1])
        assert left == {}, f"processes left behind: {left}"
        return where, cluster.addresses[0], res


@pytest.mark.timeout(420)
def test_mnist_recipe_from_different_weights_equals_one_process(
    job: tuple[Path, str, subprocess.CompletedProcess[str]],
) -> None:
    where, _, two = job
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "Test set: Average loss" in two.stdout
    # One process, the same global batch (2 x 16) at the rate the 2 ranks used (2 x 0.01).
    one_args = [*SMALL, "--batch-size", "32", "--lr", "0.02", "--save", "one.pt"]
    one = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train_mnist_style.py"),
            *one_args,
            "--metrics",
            "one.json",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env() | {"OMP_NUM_THREADS": "1"},
        cwd=where,
        timeout=200,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    got, want = torch.load(where / "two.pt"), torch.load(where / "one.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).abs().max().item() < TOL, name
    metrics = json.loads((where / "two.json").read_text())
    alone = json.loads((where / "one.json").read_text())
    assert metrics["size"] == 2 and alone["size"] == 1
    assert metrics["test_loss"] == pytest.approx(alone["test_loss"], rel=TOL, abs=TOL)
    assert metrics["accuracy"] == pytest.approx(alone["accuracy"], abs=TOL)


@pytest.mark.timeout(420)
def test_synthetic_benchmark_reports_images_per_second_over_hosts(
    job: tuple[Path, str, subprocess.CompletedProcess[str]],
) -> None:
    where, addr, res = job
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"{addr}/0: Total img/sec on 2 CPU(s)" in res.stdout, res.stdout[-2000:]
    result = json.loads((where / "bench.json").read_text())
    assert result["size"] == 2 and len(result["iters"]) == 2
    assert result["img_sec_total"] > 0
