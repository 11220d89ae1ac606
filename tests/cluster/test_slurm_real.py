"""A real Slurm cluster (slurmctld, a slurmd per emulated host, munge) runs manygpu jobs.

Both documented recipes go through the real scheduler, with the variables
Slurm itself gives a task (nothing is written by hand):

- ``sbatch`` of a script whose ``srun`` starts ``manygpu launch --nproc-per-node 2``
  once per node (``--ntasks-per-node=1``): the launchers find their node, the
  node count and where to meet from Slurm;
- ``srun --ntasks-per-node=2 python script.py``: one task per rank, no
  launcher; ``Parallel`` reads ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``
  and the step's node list. (Its script is :data:`TASK`, not
  ``scripts/strategy_equivalence.py``, which records ``MASTER_ADDR`` and
  ``GROUP_RANK``: variables a launcher sets and srun does not.)

The 2 nodes x 2 processes must train exactly as one process (max |difference|
< 1e-5, fp32 SGD). A third test: ``srun --ntasks-per-node=1 manygpu launch``
inside an allocation of several tasks per node, where Slurm ignores the flag and
starts several launchers per node, is refused in one line (not run as separate
jobs). Slurm's packages are installed with apt-get when
missing (the module skips, saying why, when that fails).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs import subprocess_env
from reference import reference_train
from slurm_hosts import SlurmHosts, ensure_slurm

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPT = Path(__file__).parent / "scripts" / "strategy_equivalence.py"
STEPS, BATCH = 4, 12

TASK = '''\
"""One srun task = one rank: train under STRATEGY, record what Parallel and Slurm said."""
import os
import sys

import torch
from reference import make_data, make_model
from torch import nn

from manygpu import Parallel

out_dir, steps, batch, strategy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with Parallel(strategy=strategy, timeout_s=60) as par:
    model = par.prepare(make_model())
    opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    per = batch // par.world_size
    x, y = make_data(steps * batch)
    for step in range(steps):
        start = step * batch + par.rank * per
        par.backward(nn.functional.mse_loss(model(x[start : start + per]), y[start : start + per]))
        opt.step()
        opt.zero_grad()
    params = torch.cat([p.detach().reshape(-1) for p in par.unwrap(model).parameters()])
    info = par.cluster
    record = {
        "params": params,
        "world": par.world_size,
        "rank": par.rank,
        "local_rank": info.local_rank,
        "local_world": info.local_world_size,
        "node": info.node_rank,
        "source": info.source,
        "master_addr": info.master_addr,
        "host": os.uname().nodename,
        "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")},
    }
    torch.save(record, os.path.join(out_dir, f"{strategy}-rank{par.rank}.pt"))
'''


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmHosts]:
    """Two emulated hosts, ``node0`` (also the controller) and ``node1``, as one Slurm cluster."""
    why = ensure_slurm()
    if why is not None:
        pytest.skip(why)
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster, SlurmHosts(cluster) as hosts:
        yield hosts
        left = hosts.wait_until_clean()
    assert not left, f"a job left processes behind: {left}"


def _job_env() -> dict[str, str]:
    """What a user's shell holds when they submit: the sources, the job's secret."""
    return subprocess_env(namespace=True)


def _job_output(where: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in where.glob("slurm-*.out"))


def _records(out: Path, strategy: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{strategy}-rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.mark.timeout(300)
def test_sbatch_srun_manygpu_launch_per_node_matches_one_process(
    slurm: SlurmHosts, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launch = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", "2"]
    job = [*launch, "--timeout", "60", str(SCRIPT), str(out), str(STEPS), str(BATCH), "ddp,fsdp"]
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/sh\n"
        "#SBATCH --nodes=2\n"
        "#SBATCH --ntasks-per-node=1\n"
        "#SBATCH --time=4\n"
        f"#SBATCH --output={tmp_path / 'slurm-%j.out'}\n"
        f"env | grep '^SLURM_' | sort > {tmp_path / 'batch-env.txt'}\n"
        f"srun {' '.join(job)}\n"
    )
    res = slurm.run(
        ["sbatch", "--wait", "--export=ALL", f"--chdir={tmp_path}", str(script)],
        env=_job_env(),
        timeout=240,
        check=False,
    )
    job_out = _job_output(tmp_path)
    assert res.returncode == 0, f"{res.stdout}{res.stderr}\njob output:\n{job_out[-4000:]}"
    ref = reference_train(STEPS, BATCH)
    for strategy in ("ddp", "fsdp"):
        for rank, rec in enumerate(_records(out, strategy, 4)):
            assert rec["world"] == 4 and rec["node"] == rank // 2, (strategy, rank, rec)
            assert rec["host"] == f"node{rank // 2}"  # the launcher of Slurm's node rank
            assert rec["master_addr"] == "127.0.0.1"  # the node's door to the gated store
            assert (rec["params"] - ref).abs().max().item() < 1e-5, (strategy, rank)


@pytest.mark.timeout(300)
def test_srun_once_per_rank_matches_one_process(slurm: SlurmHosts, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    task = tmp_path / "task.py"
    task.write_text(TASK)
    argv = [sys.executable, str(task), str(out), str(STEPS), str(BATCH), "ddp"]
    res = slurm.run(
        ["srun", "--nodes=2", "--ntasks-per-node=2", "--export=ALL", f"--chdir={tmp_path}", *argv],
        env=_job_env(),
        timeout=240,
        check=False,
    )
    assert res.returncode == 0, f"{res.stdout[-3000:]}{res.stderr[-4000:]}"
    ref = reference_train(STEPS, BATCH)
    records = _records(out, "ddp", 4)
    slurm_env = records[0]["slurm"]
    print(
        "SLURM_ variables of task 0:", *sorted(f"{k}={v}" for k, v in slurm_env.items()), sep="\n"
    )
    for rank, rec in enumerate(records):
        assert rec["source"] == "slurm" and rec["world"] == 4, rec
        assert (rec["node"], rec["local_rank"], rec["local_world"]) == (rank // 2, rank % 2, 2)
        assert rec["host"] == f"node{rank // 2}"
        assert rec["master_addr"] == "node0"  # the step's first node, from its node list
        assert (rec["params"] - ref).abs().max().item() < 1e-5, rank


@pytest.mark.timeout(300)
def test_srun_one_launcher_per_node_in_an_allocation_of_several_tasks_per_node(
    slurm: SlurmHosts, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launch = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", "1"]
    job = [*launch, "--timeout", "60", str(SCRIPT), str(out), str(STEPS), str(BATCH), "ddp"]
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/sh\n"
        "#SBATCH --nodes=2\n"
        "#SBATCH --ntasks-per-node=2\n"  # one task per GPU: the usual allocation
        "#SBATCH --time=4\n"
        f"#SBATCH --output={tmp_path / 'slurm-%j.out'}\n"
        f"srun --ntasks-per-node=1 {' '.join(job)}\n"  # the README's recipe
    )
    res = slurm.run(
        ["sbatch", "--wait", "--export=ALL", f"--chdir={tmp_path}", str(script)],
        env=_job_env(),
        timeout=240,
        check=False,
    )
    job_out = _job_output(tmp_path)
    # An allocation of 2 tasks per node exports SLURM_NTASKS=4, so srun ignores
    # --ntasks-per-node=1 (it only warns) and starts 2 launchers per node: each would
    # run a job of its own, silently. Each launcher refuses in one line instead.
    assert res.returncode != 0, job_out[-4000:]
    refusal = (
        "manygpu launch: error: srun started 4 launchers on 2 node(s); manygpu launch "
        "starts each node's processes itself, so start one per node: srun --ntasks=$SLURM_NNODES "
        "--ntasks-per-node=1 manygpu launch ..., or srun the script itself (one task per GPU)"
    )
    assert refusal in job_out.splitlines(), job_out[-3000:]
    assert "Traceback" not in job_out, job_out[-3000:]
    assert not list(out.glob("ddp-rank*.pt"))
