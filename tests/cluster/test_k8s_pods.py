"""Kubernetes stops and restarts pods; a job of ``manygpu launch`` with a Checkpointer
loses no step to either (issue 24). Two emulated hosts play the two pods of a Kubeflow
Trainer v2 TrainJob: each runs ``manygpu launch preempt_recipe.py ...`` with no flags and
exactly the torch plugin's ``PET_*`` environment (node 0 named by its headless-service
DNS name through the hosts' ``/etc/hosts``), one process each (``PET_NPROC_PER_NODE=1``:
what crosses the pods is the point, and each process costs seconds of CPU; ``auto`` is
tests/unit/test_engines.py's), the recipe's GPT under fsdp (tests/helpers/preempt_job.py)
sharded over both pods, on a checkpoint directory both pods share. This is also the
Trainer v2 case of the engines' contracts (tests/cluster/test_engine_contracts.py).

- Deleted pods (preemption, eviction, a drained node): kubelet sends SIGTERM to the
  container's PID 1 (here each pod's launcher, and only it) and SIGKILL after
  ``terminationGracePeriodSeconds``. Every launcher must end within :data:`GRACE_S`
  having saved one checkpoint (it verifies); the pods started again with the same
  environment and command resume from it and finish.
- A pod's container killed (OOM, a crashed process: its launcher and ranks SIGKILLed):
  the other pod's ranks lose their peer and its launcher exits non-zero; under
  ``restartPolicy: OnFailure`` kubelet restarts every container that exited non-zero,
  and the job resumes from the newest periodic checkpoint (every :data:`EVERY` steps).
  The launchers keep their default ``--max-restarts 0``: a launcher whose job broke
  exits, and the restarted pods meet in a fresh static rendezvous.
- A pod restarted before node 0 has noticed (node 0 still serves the run it left) waits
  for node 0's next rendezvous instead of joining the old one.

All three happen to one job, one after the other (SIGTERM, then pod 1 killed and
restarted early, then pod 0's restart on failure): each start of the pods costs
~8 s of CPU, and every event still restarts from what the one before left.

No API server and no kubelet run here: the test itself signals the processes and
restarts a pod's command as kubelet would (at once, each at most :data:`MAX_RESTARTS`
times; kubelet's back-off only delays it). Every run must equal one uninterrupted run of
the same 2 ranks (local gloo ranks, ``OMP_NUM_THREADS=1`` as on the pods) bit for bit:
every step's loss and the final parameters, tolerance zero.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil
import pytest
import torch
from dist_harness import run_ranks
from jobs import subprocess_env
from preempt_job import train_to

from manygpu.checkpoint.export import inspect
from manygpu.checkpoint_io import layout
from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

RECIPE = Path(__file__).parent / "scripts" / "preempt_recipe.py"
TOTAL, SLEEP_S, EVERY = 14, 0.25, 2
GRACE_S = 30.0
"""terminationGracePeriodSeconds' stand-in: a SIGTERMed launcher must be gone by then."""
MAX_RESTARTS = 3
MASTER = "train-node-0-0.train"


def _trainer_v2(node: int, port: int) -> dict[str, str]:
    """What Kubeflow Trainer's torch plugin injects into node ``node`` of TrainJob ``train``."""
    return {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(node),
        "PET_MASTER_ADDR": MASTER,
        "PET_MASTER_PORT": str(port),
        "JOB_COMPLETION_INDEX": str(node),
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    }


@dataclass
class Pod:
    """One pod's container: its command and environment, started again as kubelet would."""

    cluster: EmulatedCluster
    node: int
    argv: list[str]
    env: dict[str, str]
    logs: Path
    starts: int = 0
    proc: subprocess.Popen[str] | None = None
    _log: IO[str] | None = None

    def start(self) -> None:
        self._close_log()
        self._log = (self.logs / f"pod{self.node}-{self.starts}.log").open("w")
        self.proc = self.cluster.popen(
            self.node,
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self.starts += 1

    @property
    def launcher(self) -> subprocess.Popen[str]:
        assert self.proc is not None
        return self.proc

    def output(self, start: int) -> str:
        return (self.logs / f"pod{self.node}-{start}.log").read_text()

    def kill_container(self) -> list[int]:
        """SIGKILL the launcher and every process under it (the container dies)."""
        root = psutil.Process(self.launcher.pid)
        procs = [root, *root.children(recursive=True)]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        return [p.pid for p in procs]

    def stop(self) -> None:
        """Whatever is left of this pod (the test's own cleanup)."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill_container()
            self.proc.wait(timeout=30)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class Job:
    """The TrainJob's two pods on one shared checkpoint directory; rank 0 (pod 0) records
    each run's losses, kept per run of pod 0 as kubelet keeps a container's logs."""

    root: Path
    pods: list[Pod]
    runs: list[dict[int, float]] = field(default_factory=list)

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def progress(self) -> int:
        path = self.out / "progress-0"
        text = path.read_text() if path.exists() else ""
        return int(text) if text.strip() else 0

    def collect_run(self) -> None:
        """Pod 0's launcher ended: keep its run's losses, clear them for the next run."""
        losses = self.out / "losses-0.json"
        if losses.exists():
            self.runs.append({int(s): v for s, v in json.loads(losses.read_text()).items()})
            losses.unlink()
        (self.out / "progress-0").unlink(missing_ok=True)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            ended = [p for p in self.pods if p.launcher.poll() is not None]
            if ended or time.monotonic() > deadline:
                why = "a launcher ended" if ended else f"not within {timeout_s:.0f} s"
                raise AssertionError(f"waiting for {what}: {why}\n{self.said()}")
            time.sleep(0.1)

    def said(self) -> str:
        return "\n".join(
            f"--- pod {p.node} run {s}:\n{p.output(s)[-3000:]}"
            for p in self.pods
            for s in range(p.starts)
        )

    def stop(self) -> None:
        for pod in self.pods:
            pod.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as hosts:
        hosts.name_hosts({MASTER: 0, "train-node-0-1.train": 1})
        yield hosts


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict[str, Any]]:
    """One uninterrupted run of the same 2 ranks: (each step's loss, the final parameters)."""
    where = tmp_path_factory.mktemp("reference")
    params = run_ranks(
        train_to,
        2,
        str(where / "ckpt"),
        str(where),
        TOTAL,
        0.0,
        extra_env={"OMP_NUM_THREADS": "1"},
        timeout=180,
    )[0]
    losses = json.loads((where / "losses-0.json").read_text())
    return {int(s): v for s, v in losses.items()}, params


@pytest.fixture
def job(cluster: EmulatedCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Job]:
    """The TrainJob's pods (not yet started), each on its own port per test."""
    port, every = request.param
    root = tmp_path
    (root / "out").mkdir()
    (root / "logs").mkdir()
    argv = [sys.executable, "-m", "manygpu", "launch", str(RECIPE), str(root / "ckpt")]
    argv += [str(root / "out"), str(TOTAL), str(SLEEP_S), str(every)]
    pods = [
        Pod(
            cluster,
            node,
            argv,
            subprocess_env(namespace=True) | _trainer_v2(node, port),
            root / "logs",
        )
        for node in range(2)
    ]
    made = Job(root, pods)
    try:
        yield made
    finally:
        made.stop()


def _same_as_reference(job: Job, reference: tuple[dict[int, float], dict[str, Any]]) -> None:
    ref_losses, ref_params = reference
    for run in job.runs:
        differ = {s: (v, ref_losses[s]) for s, v in run.items() if v != ref_losses[s]}
        assert not differ, f"losses differ from the uninterrupted run's: {differ}"
    params = torch.load(job.out / "params.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    differ_p = [k for k in ref_params if not torch.equal(params[k], ref_params[k])]
    assert not differ_p, f"parameters differ from the uninterrupted run's: {differ_p}"


def _run_to_the_end(
    job: Job, timeout_s: float, starts: int, until: Callable[[], bool] | None = None
) -> list[tuple[int, int, int]]:
    """kubelet under ``restartPolicy: OnFailure``: a container that exits non-zero is
    started again at once (same command, same environment) while its pod has had fewer
    than ``starts`` starts in all; returns (pod, run, exit code) of every launcher that
    ended from now on, in order. ``until``: stop as soon as it holds, the pods running."""
    ended: list[tuple[int, int, int]] = []
    done: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(done) < len(job.pods) and not (until is not None and until()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not done within {timeout_s:.0f} s: {ended}\n{job.said()}")
        for pod in job.pods:
            code = pod.launcher.poll()
            if pod.node in done or code is None:
                continue
            ended.append((pod.node, pod.starts - 1, code))
            if pod.node == 0:
                job.collect_run()
            if code == 0:
                done.add(pod.node)
            elif pod.starts < starts:
                pod.start()
            else:
                raise AssertionError(
                    f"pod {pod.node} failed {pod.starts} times: {ended}\n{job.said()}"
                )
        time.sleep(0.1)
    return ended


def _workers(pod: Pod) -> list[psutil.Process]:
    return psutil.Process(pod.launcher.pid).children(recursive=True)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("job", [(29531, EVERY)], indirect=True)
def test_stopped_then_killed_pods_resume_bit_identically_and_an_early_pod_waits(
    job: Job, reference: tuple[dict[int, float], dict[str, Any]]
) -> None:
    """One TrainJob through three events, each restart with the same command and
    environment: (1) SIGTERM to every pod's PID 1: both launchers save and end with
    128 + SIGTERM within the grace period; the pods started again resume right after
    the saved step. (2) Pod 1's container killed while pod 0's ranks are frozen (so they
    cannot notice) and restarted at once: the new pod must not join pod 0's old store,
    where its workers would meet the old run's keys, but wait. (3) Pod 0's ranks thawed
    lose pod 1: its launcher names pod 1's host and exits non-zero, kubelet restarts
    it, the waiting pod 1 joins its next rendezvous, and the job resumes from the
    newest periodic checkpoint. Every run's losses and the end equal the
    uninterrupted run's."""
    step = _sigterm_every_pod(job)
    for pod in job.pods:  # the pods started again: same environment, same command
        pod.start()
    # A periodic checkpoint after the SIGTERM one (saved before the next step starts).
    job.wait_for(f"step {step + EVERY + 1}", lambda: job.progress() >= step + EVERY + 1, 120)
    killed_at = job.progress()
    newest = int(layout.read_meta(layout.committed(job.ckpt)[-1])["step"])
    _kill_pod1_and_restart_it_early(job)
    ended = _run_to_the_end(job, 240, starts=2 + MAX_RESTARTS)
    print(f"killed pod 1 at step {killed_at}, after SIGTERM at {step}; then ended: {ended}")
    lead = (
        f"manygpu: the first failure was on the host(s) at {job.pods[1].cluster.addresses[1]} "
        "(train-node-0-1.train), not here"
    )
    assert ended[0][:2] == (0, 1) and ended[0][2] != 0, (ended, job.said())
    assert lead in job.pods[0].output(1), job.said()
    # Pod 1's early start waited for pod 0's next rendezvous, then finished with it.
    assert [n for n, _, _ in ended].count(1) == 1 and ended[-1][2] == 0, (ended, job.said())

    assert len(job.runs) == 3, job.runs
    assert min(job.runs[1]) == step + 1 and max(job.runs[1]) >= killed_at, job.runs
    resumed = min(job.runs[2]) - 1
    assert resumed % EVERY == 0 and newest <= resumed <= max(job.runs[1]), (resumed, newest)
    assert max(job.runs[2]) == TOTAL, job.runs
    _same_as_reference(job, reference)


def _sigterm_every_pod(job: Job) -> int:
    """Start both pods, SIGTERM each launcher (kubelet: PID 1 alone) after 3 steps;
    check both ended in time having saved; the step they saved."""
    for pod in job.pods:
        pod.start()
    job.wait_for("3 steps", lambda: job.progress() >= 3, 120)
    for pod in job.pods:
        pod.launcher.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    codes = []
    for pod in job.pods:
        left = GRACE_S - (time.monotonic() - signalled)
        try:
            codes.append(pod.launcher.wait(timeout=max(left, 0.1)))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"pod {pod.node} still runs {GRACE_S:.0f} s after SIGTERM\n{job.said()}"
            ) from None
    took = time.monotonic() - signalled
    # Not 0: a Job's pod that exits 0 has Succeeded, and its index would never run again.
    assert codes == [128 + signal.SIGTERM] * 2, (codes, job.said())
    job.collect_run()
    info = inspect(layout.committed(job.ckpt)[-1])  # the newest: the notice's save
    assert info["status"] == "ok" and info["world_size"] == 2 and info["strategy"] == "fsdp", info
    step = info["step"]
    assert f"manygpu: SIGTERM: saved step {step} " in job.pods[0].output(0), job.said()
    assert max(job.runs[0]) == step, (step, job.runs)
    print(f"SIGTERM: both launchers ended {took:.1f} s after it, having saved step {step}")
    return int(step)


def _kill_pod1_and_restart_it_early(job: Job) -> None:
    """Pod 1's container killed while pod 0's ranks are frozen, and restarted at once:
    it must wait for pod 0's next rendezvous, starting no worker on the old store."""
    frozen = _workers(job.pods[0])
    for proc in frozen:
        proc.suspend()
    try:
        job.pods[1].kill_container()
        assert job.pods[1].launcher.wait(timeout=30) == -signal.SIGKILL
        job.pods[1].start()
        again = job.pods[1].starts - 1
        port = job.pods[0].env["PET_MASTER_PORT"]
        stale = f"manygpu: node 1: the rendezvous store at {MASTER}:{port} is still"
        deadline = time.monotonic() + 60
        while stale not in job.pods[1].output(again):
            assert job.pods[1].launcher.poll() is None, job.said()
            assert time.monotonic() < deadline, job.said()
            time.sleep(0.2)
        assert not _workers(job.pods[1]), "the restarted pod started workers on the old store"
    finally:
        for proc in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()
