"""A real Slurm cluster (slurmctld, a slurmd per emulated host, munge) runs manygpu jobs.

Both documented recipes go through the real scheduler, with the variables
Slurm itself gives a task (nothing is written by hand):

- ``sbatch`` of a script whose ``srun`` starts ``manygpu launch --nproc-per-node 2``
  once per node (``--ntasks-per-node=1``): the launchers find their node, the
  node count and where to meet from Slurm;
- ``srun --ntasks-per-node=2 python script.py``: one task per rank, no
  launcher; ``Parallel`` reads ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``
  and the step's node list (its script is :data:`TASK`).

Both train the real recipe of tests/helpers/recipes.py (the zoo's GPT with a
ModuleList of blocks and a tied head, AdamW groups, warmup + cosine, clipping,
22 samples that divide by neither the world nor the batch) on 2 nodes x 2
processes, every parameter within AdamW's 1e-4 of one plain process. Also: one
launcher per node inside an allocation of several tasks per node (Slurm ignores
``--ntasks-per-node=1`` there) is refused in one line; a warned, then requeued
job saves and resumes bit for bit; a node whose processes die is named; an elastic
job goes on without a lost node; ``srun manygpu doctor --all-ranks`` checks every
node and tells the 200 Mbit/s link between them from a node's own pairs. The
requeued, killed and elastic jobs run one rank per node (a rank process costs ~3 s
of CPU): ranks per node are the first two jobs' subject; the refused launchers run in
a one-node allocation (each node's launchers refuse alike, ~2 CPU-s a launcher).
Slurm's packages are installed with apt-get when missing (the module skips, saying
why, when that fails).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from jobs import subprocess_env
from preempt_job import train_to
from recipes import Recipe, max_diff, reference_train
from slurm_hosts import SlurmHosts, ensure_slurm

from manygpu.checkpoint_io import layout
from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPT = Path(__file__).parent / "scripts" / "recipe_equivalence.py"
ADAM_TOL = 1e-4  # AdamW's tolerance, as in tests/distributed/test_real_models.py

TASK = '''\
"""One srun task = one rank: the recipe under STRATEGY; record what Parallel and Slurm said."""
import os
import sys

import torch
from recipes import Recipe, train_parallel

from manygpu import Parallel

out_dir, strategy = sys.argv[1], sys.argv[2]
with Parallel(strategy=strategy, timeout_s=60) as par:  # the group, from Slurm's variables
    (result,) = train_parallel([Recipe("gpt")], {"strategy": strategy, "timeout_s": 60})
    info = par.cluster
    record = {
        "params": result.get("params"),
        "error": result.get("error"),
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
    # 200 Mbit/s between the hosts: the doctor's transfers tell them from a host's own pairs.
    with EmulatedCluster(2, LinkShape(rate="200mbit")) as cluster, SlurmHosts(cluster) as hosts:
        yield hosts
        left = hosts.wait_until_clean()
    assert not left, f"a job left processes behind: {left}"


@pytest.fixture(scope="module")
def gpt_ref() -> dict[str, torch.Tensor]:
    """The recipe's GPT trained in one process on the 4 ranks' global batches: the
    parameters both recipes must match (trained once for both)."""
    return reference_train(Recipe("gpt"), 4)["params"]


def _job_env() -> dict[str, str]:
    """What a user's shell holds when they submit: the sources, the job's secret."""
    return subprocess_env(namespace=True)


def _job_output(where: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in where.glob("slurm-*.out"))


def _sbatch_file(
    tmp_path: Path, lines: list[str], per_node: int = 1, minutes: int = 4, nodes: int = 2
) -> Path:
    """A batch script for ``nodes`` nodes x ``per_node`` tasks: ``lines`` after the
    directives (more ``#SBATCH`` lines, then the commands); its output in
    tmp_path/slurm-JOB.out."""
    head = [
        "#!/bin/sh",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
        f"#SBATCH --time={minutes}",
        f"#SBATCH --output={tmp_path / 'slurm-%j.out'}",
    ]
    script = tmp_path / "job.sbatch"
    script.write_text("\n".join([*head, *lines]) + "\n")
    return script


def _launch(nproc: str) -> list[str]:
    """``manygpu launch --nproc-per-node NPROC`` as this interpreter runs it."""
    return [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", nproc]


def _submit(slurm: SlurmHosts, script: Path, tmp_path: Path, env: dict[str, str]) -> str:
    """``sbatch`` without waiting; the job's id."""
    sbatch = ["sbatch", "--parsable", "--export=ALL", f"--chdir={tmp_path}", str(script)]
    return slurm.run(sbatch, env=env).stdout.strip().split(";")[0]


def _records(out: Path, strategy: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{strategy}-rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.mark.timeout(300)
def test_sbatch_srun_manygpu_launch_per_node_matches_one_process(
    slurm: SlurmHosts, gpt_ref: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launch = _launch("2")
    job = [*launch, "--timeout", "60", str(SCRIPT), str(out), "ddp,fsdp"]
    script = _sbatch_file(
        tmp_path,
        [f"env | grep '^SLURM_' | sort > {tmp_path / 'batch-env.txt'}", f"srun {' '.join(job)}"],
    )
    res = slurm.run(
        ["sbatch", "--wait", "--export=ALL", f"--chdir={tmp_path}", str(script)],
        env=_job_env(),
        timeout=240,
        check=False,
    )
    job_out = _job_output(tmp_path)
    assert res.returncode == 0, f"{res.stdout}{res.stderr}\njob output:\n{job_out[-4000:]}"
    ref = gpt_ref
    for strategy in ("ddp", "fsdp"):
        for rank, rec in enumerate(_records(out, strategy, 4)):
            assert rec["error"] is None and rec["data_world"] == 4, (strategy, rank, rec["error"])
            assert rec["world"] == 4 and rec["node"] == rank // 2, (strategy, rank, rec)
            assert rec["host"] == f"node{rank // 2}"  # the launcher of Slurm's node rank
            assert rec["master_addr"] == "127.0.0.1"  # the node's door to the gated store
            assert max_diff(rec["params"], ref) < ADAM_TOL, (strategy, rank)


@pytest.mark.timeout(300)
def test_srun_once_per_rank_matches_one_process(
    slurm: SlurmHosts, gpt_ref: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    task = tmp_path / "task.py"
    task.write_text(TASK)
    argv = [sys.executable, str(task), str(out), "ddp"]
    res = slurm.run(
        ["srun", "--nodes=2", "--ntasks-per-node=2", "--export=ALL", f"--chdir={tmp_path}", *argv],
        env=_job_env(),
        timeout=240,
        check=False,
    )
    assert res.returncode == 0, f"{res.stdout[-3000:]}{res.stderr[-4000:]}"
    ref = gpt_ref
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
        assert rec["error"] is None and max_diff(rec["params"], ref) < ADAM_TOL, rank


@pytest.mark.timeout(300)
def test_srun_one_launcher_per_node_in_an_allocation_of_several_tasks_per_node(
    slurm: SlurmHosts, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launch = _launch("1")
    job = [*launch, "--timeout", "60", str(SCRIPT), str(out), "ddp"]
    # 2 tasks per node (one per GPU: the usual allocation), the README's recipe in it. One
    # node: the refusal is each node's (its launchers count), and a launcher costs ~2 CPU-s.
    srun = f"srun --ntasks-per-node=1 {' '.join(job)}"
    script = _sbatch_file(tmp_path, [srun], per_node=2, nodes=1)
    res = slurm.run(
        ["sbatch", "--wait", "--export=ALL", f"--chdir={tmp_path}", str(script)],
        env=_job_env(),
        timeout=240,
        check=False,
    )
    job_out = _job_output(tmp_path)
    # An allocation of 2 tasks per node exports its task count (SLURM_NTASKS=2 on this
    # one node), so srun ignores --ntasks-per-node=1 (it only warns) and starts 2
    # launchers per node: each would run a job of its own, silently. Each launcher
    # refuses in one line instead.
    assert res.returncode != 0, job_out[-4000:]
    refusal = (
        "manygpu launch: error: srun started 2 launchers on 1 node(s); manygpu launch "
        "starts each node's processes itself, so start one per node: srun --ntasks=$SLURM_NNODES "
        "--ntasks-per-node=1 manygpu launch ..., or srun the script itself (one task per GPU)"
    )
    assert refusal in job_out.splitlines(), job_out[-3000:]
    assert "Traceback" not in job_out, job_out[-3000:]
    assert not list(out.glob("ddp-rank*.pt"))


PREEMPT = Path(__file__).parent / "scripts" / "preempt_recipe.py"
PREEMPT_STEPS, PREEMPT_SLEEP_S = 15, 0.3


def _progress(out: Path, attempt: int) -> int:
    path = out / f"progress-{attempt}"
    return int(path.read_text() or 0) if path.exists() else 0


def _wait_for(what: str, ready: Any, slurm: SlurmHosts, tmp_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            queue = slurm.run(["squeue", "-h", "-o", "%i %T %r"], check=False).stdout
            pytest.fail(f"{what} not within {timeout_s}s; squeue: {queue}\n{_job_output(tmp_path)}")
        time.sleep(0.3)


def _start_requeued_now(slurm: SlurmHosts, job: str, tmp_path: Path) -> None:
    """Once the job is pending again, start it now: Slurm holds a requeued job for
    ~2 minutes (its begin time), which an administrator may move, as here."""

    def pending() -> bool:
        state = slurm.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout
        return state.strip() == "PENDING"

    _wait_for("the requeue", pending, slurm, tmp_path, 60)
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])


@pytest.mark.timeout(300)
def test_warned_then_requeued_job_resumes_bit_identically(
    slurm: SlurmHosts, tmp_path: Path
) -> None:
    """A batch job of ``srun manygpu launch`` on 2 nodes x 1 rank (a launcher passing a
    signal on to several ranks: tests/launch/test_checkpoint_faults.py, test_k8s_pods.py),
    the recipe's GPT under fsdp with a Checkpointer: Slurm's warning signal (``scancel
    --signal=USR1``, what ``--signal=USR1@N`` sends N seconds before the time limit)
    makes it save and
    requeue itself; ``scontrol requeue`` (SIGTERM to every process, SIGKILL after
    KillWait=5 s) makes it save again; the third run finishes. Every step's loss and
    the final parameters equal an uninterrupted run's bit for bit."""
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    launch = [*_launch("1"), "--timeout", "60"]
    args = [str(PREEMPT), str(ckpt), str(out), str(PREEMPT_STEPS), str(PREEMPT_SLEEP_S)]
    directives = ["#SBATCH --requeue", "#SBATCH --signal=USR1@90", "#SBATCH --open-mode=append"]
    script = _sbatch_file(tmp_path, [*directives, f"srun {' '.join([*launch, *args])}"], minutes=6)
    env = _job_env() | {"OMP_NUM_THREADS": "1"}
    job = _submit(slurm, script, tmp_path, env)
    try:
        _wait_for("3 steps", lambda: _progress(out, 0) >= 3, slurm, tmp_path, 90)
        slurm.run(["scancel", "--signal=USR1", job])
        _start_requeued_now(slurm, job, tmp_path)
        _wait_for("the requeued run", lambda: _progress(out, 1) >= 2, slurm, tmp_path, 90)
        first = min(int(s) for s in json.loads((out / "losses-1.json").read_text()))
        _wait_for("2 more steps", lambda: _progress(out, 1) >= first + 1, slurm, tmp_path, 60)
        slurm.run(["scontrol", "requeue", job])
        _start_requeued_now(slurm, job, tmp_path)
        _wait_for("the end", lambda: (out / "params.pt").exists(), slurm, tmp_path, 90)
    finally:
        slurm.run(["scancel", job], check=False)
    said = _job_output(tmp_path)
    assert "manygpu: SIGUSR1: saved step" in said and "manygpu: SIGTERM: saved step" in said, said
    runs = [json.loads((out / f"losses-{a}.json").read_text()) for a in range(3)]
    steps = [sorted(int(s) for s in run) for run in runs]
    assert steps[0][0] == 1 and steps[2][-1] == PREEMPT_STEPS, steps
    for before, after in itertools.pairwise(steps):
        assert after[0] == before[-1] + 1, steps  # resumed right after the saved step
    (tmp_path / "ref").mkdir()
    ref = run_ranks(
        train_to,
        2,
        str(tmp_path / "ref-ck"),
        str(tmp_path / "ref"),
        PREEMPT_STEPS,
        0.0,
        extra_env={"OMP_NUM_THREADS": "1"},
        timeout=180,
    )[0]
    ref_losses = json.loads((tmp_path / "ref" / "losses-0.json").read_text())
    for run in runs:
        assert all(loss == ref_losses[s] for s, loss in run.items()), (run, ref_losses)
    params = torch.load(out / "params.pt", weights_only=True)
    assert all(torch.equal(params[k], ref[k]) for k in ref), "parameters differ from the reference"


@pytest.mark.timeout(240)
def test_srun_doctor_all_ranks_checks_every_node(slurm: SlurmHosts, tmp_path: Path) -> None:
    """``srun --ntasks-per-node=1 manygpu doctor --all-ranks`` inside an allocation: one
    report (printed once, not once per node) over both nodes, with the live all-reduce
    and every rank pair's transfer across the hosts; exit 0 (warnings: no GPU here).
    Pairs inside a host go over loopback-fast memory, pairs across hosts over the
    200 Mbit/s link (25 MB/s): the doctor sees the difference. Each node is checked and
    told apart, and announces its own address to gloo."""
    argv = [sys.executable, "-m", "manygpu", "doctor", "--all-ranks", "--json"]
    argv += ["--p2p-bytes", "1M"]
    srun = ["srun", "--nodes=2", "--ntasks-per-node=1", "--export=ALL", f"--chdir={tmp_path}"]
    res = slurm.run([*srun, *argv], env=_job_env(), timeout=180, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads(res.stdout)  # one document: node 0's launcher prints it
    assert report["counts"]["fail"] == 0, report["checks"]
    assert sorted(n["system"]["hostname"] for n in report["nodes"]) == ["node0", "node1"]
    live = report["live"]
    assert live["world_size"] == 4 and live["hosts"] == ["node0", "node0", "node1", "node1"]
    assert live["all_reduce_error"] is None
    pairs = {(p["a"], p["b"]) for p in live["pairs"] if p["error"] is None}
    assert pairs == {(a, b) for a in range(4) for b in range(a + 1, 4)}, live["pairs"]
    cross = [p["gbps"] for p in live["pairs"] if live["hosts"][p["a"]] != live["hosts"][p["b"]]]
    local = [p["gbps"] for p in live["pairs"] if live["hosts"][p["a"]] == live["hosts"][p["b"]]]
    assert len(cross) == 4 and len(local) == 2
    assert max(cross) < 0.05 < min(local), live["pairs"]
    gloo = sorted(n["network"]["gloo_address"] for n in report["nodes"])
    assert gloo == sorted(slurm.cluster.addresses)
    checks = {c["name"]: c["status"] for c in report["checks"]}
    assert checks["consistency"] == "ok" and checks["all_reduce"] == "ok"
    assert len({c["host"] for c in report["checks"] if c["name"] == "shm"}) == 2


def _job_gone(slurm: SlurmHosts, job: str) -> bool:
    return not slurm.run(["squeue", "-h", "-j", job], check=False).stdout.strip()


@pytest.mark.timeout(300)
def test_a_node_whose_processes_die_is_named(slurm: SlurmHosts, tmp_path: Path) -> None:
    """node1's launcher and rank SIGKILLed mid-training (what an OOM kill or a
    crashed node leaves behind; slurmd lives on): the job ends on its own, failed,
    with a verdict naming node1, and leaves no process behind. One rank per node:
    the verdict is the node's, whatever its rank count."""
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    launch = [*_launch("1"), "--timeout", "30"]
    args = [str(PREEMPT), str(ckpt), str(out), "100000", "0.2"]
    script = _sbatch_file(tmp_path, [f"srun {' '.join([*launch, *args])}"])
    job = _submit(slurm, script, tmp_path, _job_env())
    try:
        _wait_for("2 steps", lambda: _progress(out, 0) >= 2, slurm, tmp_path, 90)
        killed = slurm.kill_job_processes(1)
        assert killed, "no process of the job found on node1"
        _wait_for("the job's end", lambda: _job_gone(slurm, job), slurm, tmp_path, 120)
    finally:
        slurm.run(["scancel", job], check=False)
    said = _job_output(tmp_path).splitlines()
    ours = [line for line in said if line.startswith("manygpu:")]
    node1 = slurm.cluster.addresses[1]
    lead = (
        f"manygpu: the first failure was on the host(s) at {node1} (node1), not here: "
        "rank 0 of this node lost their connections to it"
    )
    assert ours and ours[0].startswith(lead), "\n".join(said[-60:])
    assert all("(a consequence) rank" in line for line in ours[1:]), ours
    assert "srun: error: node1: task 1: Killed" in said  # Slurm's own line names the node
    assert not slurm.wait_until_clean(), "the job left processes behind"
    slurm.wait_idle()  # node1 back in service for whatever runs next


@pytest.mark.timeout(300)
def test_an_elastic_job_goes_on_without_a_lost_node(slurm: SlurmHosts, tmp_path: Path) -> None:
    """``srun --kill-on-bad-exit=0 manygpu launch --nnodes 1:2 --max-restarts 2`` in a
    ``--no-kill`` batch job, checkpointing every 2 steps: node1's processes SIGKILLed
    mid-training; node0's launcher restarts its rank, the rendezvous closes with the
    one node left (meeting where Slurm says), and the job resumes from the newest
    checkpoint of the two nodes' run and finishes as a world of one (node0's launcher
    exits 0; srun reports node1's kill). One rank per node: what is lost is a node."""
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    launch = _launch("1")
    launch += ["--nnodes", "1:2", "--max-restarts", "2", "--timeout", "60"]
    launch += ["--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"]
    total = 10  # killed at step 4 or 5, resumed from 4: 6 steps on one node
    args = [str(PREEMPT), str(ckpt), str(out), str(total), "0.3", "2"]
    srun = f"srun --kill-on-bad-exit=0 {' '.join([*launch, *args])}"
    script = _sbatch_file(tmp_path, ["#SBATCH --no-kill", srun])
    job = _submit(slurm, script, tmp_path, _job_env())
    try:
        _wait_for("4 steps", lambda: _progress(out, 0) >= 4, slurm, tmp_path, 90)
        killed_at = _progress(out, 0)
        assert slurm.kill_job_processes(1), "no process of the job found on node1"
        _wait_for("the job's end", lambda: _job_gone(slurm, job), slurm, tmp_path, 150)
    finally:
        slurm.run(["scancel", job], check=False)
    said = _job_output(tmp_path)
    assert "srun: error: node1: task 1: Killed" in said, said[-3000:]
    assert "node0: task 0: Exited" not in said, said[-3000:]  # node0's launcher ended well
    assert (out / "params.pt").exists(), said[-3000:]
    losses = sorted(int(s) for s in json.loads((out / "losses-0.json").read_text()))
    # The restarted rank's run starts after the step it loaded, which the two nodes'
    # run saved (the one node left saves nothing before it has loaded).
    resumed = losses[0] - 1
    assert losses[-1] == total and 2 <= resumed < total and resumed % 2 == 0, (losses, killed_at)
    newest = layout.read_meta(layout.committed(ckpt)[-1])
    assert (newest["step"], newest["world_size"]) == (total, 1), newest
    assert not slurm.wait_until_clean(), "the job left processes behind"
    slurm.wait_idle()
