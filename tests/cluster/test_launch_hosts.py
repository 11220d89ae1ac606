"""``manygpu launch -H`` from one emulated host starts the job on the others over real ssh.

Each host is a network namespace running its own OpenSSH server (ssh_hosts.py);
the launch is typed on host 0, which runs its share itself. Every test ends
with no process left in any host but its sshd. Needs root, iproute2 and
openssh-server (installed when missing); skips with the reason elsewhere.
Equivalence tolerance: max |difference| < 1e-5 against one process (fp32 SGD,
only the order of the sums differs).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs import subprocess_env
from reference import reference_train
from ssh_hosts import SshHosts, ensure_openssh

from manygpu.checkpoint_io import layout
from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

SCRIPTS = Path(__file__).parent / "scripts"
CKPT_SCRIPT = Path(__file__).parents[1] / "launch" / "scripts" / "ckpt_launch.py"
STEPS = 32  # the elastic job's
TOL = 1e-5
CLUSTER_PER_TEST = True
"""Each test builds its own hosts (the ``hosts`` fixture): they may run on any worker."""


@pytest.fixture(scope="module")
def openssh() -> None:
    why = ensure_openssh()
    if why is not None:
        pytest.skip(why)


@pytest.fixture
def hosts(openssh: None) -> Iterator[tuple[EmulatedCluster, SshHosts]]:
    """Two emulated hosts at 1 Gbit/s; host 1 runs sshd. Checks nothing is left behind."""
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster, SshHosts(cluster) as ssh:
        yield cluster, ssh
        left = ssh.wait_until_clean([0, 1])
        assert left == {}, f"processes left behind: {left}"


def _argv(cluster: EmulatedCluster, ssh: SshHosts, hosts: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "manygpu",
        "launch",
        "-H",
        hosts,
        "--ssh-config",
        str(ssh.config),
        *args,
    ]


def _two(cluster: EmulatedCluster, slots: int) -> str:
    return ",".join(f"{addr}:{slots}" for addr in cluster.addresses)


def _run(
    cluster: EmulatedCluster, argv: list[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run the driver on host 0 to its end."""
    return subprocess.run(
        cluster.command(0, argv),
        capture_output=True,
        text=True,
        env=subprocess_env(namespace=True),
        timeout=timeout,
    )


def _start(
    cluster: EmulatedCluster,
    argv: list[str],
    log: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """Start the driver on host 0 in the background (``ip netns exec`` execs it: same pid)."""
    with open(log, "w") as fh:
        return cluster.popen(
            0,
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=subprocess_env(namespace=True) | (env or {}),
            cwd=cwd,
        )


def _wait_for(paths: list[Path], proc: subprocess.Popen[str], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def _command_lines_as_nobody(cluster: EmulatedCluster) -> list[str]:
    """The command line of every process in the cluster's hosts as an unprivileged user
    reads it (what ``ps`` shows): the job's, not those of other tests on this machine."""
    pids: list[str] = []
    for name in cluster.names:
        res = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        pids += res.stdout.split()
    read = 'for p in "$@"; do tr "\\0" " " < "/proc/$p/cmdline" 2>/dev/null; echo; done'
    res = subprocess.run(
        ["runuser", "-u", "nobody", "--", "sh", "-c", read, "sh", *pids],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


def _report(output: str) -> list[str]:
    """The driver's own lines (each host's lines carry the host as prefix)."""
    return [line for line in output.splitlines() if line.startswith("manygpu: ")]


@pytest.mark.timeout(240)
def test_two_hosts_two_processes_match_one_process(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    """ddp, then fsdp, in one job: each host starts once for both strategies. One
    process per host: what crosses the hosts is the point, and each process costs
    seconds of CPU (the command for several slots per host: the dry-run test)."""
    cluster, ssh = hosts
    steps, batch, strategies = 4, 12, ["ddp", "fsdp"]
    script = SCRIPTS / "strategy_equivalence.py"
    argv = _argv(cluster, ssh, _two(cluster, 1), "--timeout", "60", str(script))
    res = _run(cluster, [*argv, str(tmp_path), str(steps), str(batch), ",".join(strategies)], 200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    ref = reference_train(steps, batch)
    for strategy in strategies:
        records = [
            torch.load(tmp_path / f"{strategy}-rank{r}.pt", weights_only=True) for r in range(2)
        ]
        nodes: dict[int, list[int]] = {}
        for rank, rec in enumerate(records):
            assert rec["world"] == 2 and rec["strategy"] == strategy
            # The workers' store is their node's door on loopback (the job's secret
            # opens the gate behind it); the nodes met over the namespace network.
            assert rec["master_addr"] == "127.0.0.1"
            assert (rec["params"] - ref).abs().max().item() < TOL, strategy
            assert torch.equal(rec["params"], records[0]["params"])
            nodes.setdefault(rec["node"], []).append(rank)
        assert sorted(len(r) for r in nodes.values()) == [1, 1]
        # Every rank's line reached host 0's terminal, prefixed by its host and rank.
        line = rf"^(10\.213\.0\.[12])/(\d): rank \2 of 2 done \({strategy}\)$"
        seen = set(re.findall(line, res.stdout, re.M))
        assert {int(rank) for _, rank in seen} == {0, 1}, strategy
        assert {addr for addr, _ in seen} == set(cluster.addresses)


def test_dry_run_prints_each_hosts_command_and_starts_nothing(
    hosts: tuple[EmulatedCluster, SshHosts],
) -> None:
    cluster, ssh = hosts
    script = SCRIPTS / "steps.py"
    res = _run(cluster, [*_argv(cluster, ssh, _two(cluster, 2), "--dry-run"), str(script)], 60)
    assert res.returncode == 0, res.stderr
    head, here, there = res.stdout.splitlines()
    assert head.startswith(f"# 2 hosts, rendezvous {cluster.addresses[0]}:29400 (c10d)")
    assert here.startswith(f"{cluster.addresses[0]} (here): cd ")
    assert there.startswith(f"{cluster.addresses[1]}: ssh -T -o BatchMode=yes")
    assert f"-F {ssh.config}" in there and f"--nproc-per-node 2 {script}" in there


def test_an_unreachable_host_is_named_within_the_connect_timeout(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    cluster, ssh = hosts
    nobody = "10.213.0.3"  # in the subnet, no host behind it
    listed = f"{_two(cluster, 1)},{nobody}:1"
    start = time.monotonic()
    res = _run(
        cluster,
        [*_argv(cluster, ssh, listed), str(SCRIPTS / "steps.py"), str(tmp_path), "5", "0"],
        90,
    )
    elapsed = time.monotonic() - start
    assert res.returncode == 255, res.stderr
    (line,) = _report(res.stderr)
    assert line.startswith(f"manygpu: cannot reach host {nobody} over ssh: ssh: connect to host")
    # The default 10 s connect timeout, plus the driver's start on a loaded machine.
    assert elapsed < 40, elapsed
    assert not list(tmp_path.iterdir())  # no rank ever started


def test_a_refused_login_is_named_with_sshs_reason(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    cluster, ssh = hosts
    argv = _argv(cluster, ssh, _two(cluster, 1), str(SCRIPTS / "steps.py"), str(tmp_path), "5", "0")
    argv[argv.index(str(ssh.config))] = str(ssh.wrong_config)
    res = _run(cluster, argv, 60)
    assert res.returncode == 255, res.stderr
    (line,) = _report(res.stderr)
    assert f"cannot reach host {cluster.addresses[1]} over ssh:" in line
    assert "Permission denied (publickey)" in line
    assert not list(tmp_path.iterdir())


def test_a_version_mismatch_is_refused_naming_host_and_versions(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    cluster, ssh = hosts
    # A remote Python that finds an older torch's metadata first.
    fake = tmp_path / "old"
    (fake / "torch-1.0.0.dist-info").mkdir(parents=True)
    (fake / "torch-1.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 1.0.0\n"
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake}:$PYTHONPATH exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    argv = _argv(cluster, ssh, _two(cluster, 1), "--remote-python", str(python))
    res = _run(cluster, [*argv, str(SCRIPTS / "steps.py"), str(tmp_path), "5", "0"], 60)
    assert res.returncode == 1, res.stderr
    (line,) = _report(res.stderr)
    assert f"host {cluster.addresses[1]} has torch 1.0.0 but this machine has torch " in line
    assert torch.__version__ in line


@pytest.mark.timeout(150)
def test_the_first_failing_rank_gives_the_exit_code_and_is_reported_first(
    hosts: tuple[EmulatedCluster, SshHosts],
) -> None:
    cluster, ssh = hosts
    script = Path(__file__).parents[1] / "launch" / "scripts" / "fails_in_collective.py"
    res = _run(
        cluster,
        [*_argv(cluster, ssh, _two(cluster, 1), "--timeout", "30"), str(script), "3", "1"],
        120,
    )
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-3000:]
    report = _report(res.stderr)
    assert re.match(r"manygpu: 10\.213\.0\.[12]: rank 1 failed with exit code 3", report[0]), report
    assert all("(a consequence)" in line for line in report[1:]), report


@pytest.mark.timeout(150)
def test_ctrl_c_stops_every_process_on_every_host(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    """Also: what reaches the other host's ranks is -x, .manygpu_env and the
    forwarded variables, never the rest of this machine's environment."""
    cluster, ssh = hosts
    log = tmp_path / "driver.log"
    out = tmp_path / "out"
    out.mkdir()
    job = tmp_path / "job"  # the driver's directory, and so every host's
    job.mkdir()
    (job / ".manygpu_env").write_text("# for every host\nFROM_FILE=file value\nNCCL_DEBUG=WARN\n")
    names = ["FROM_FILE", "NCCL_DEBUG", "FROM_X", "PASSED", "SECRET_HERE"]
    argv = _argv(cluster, ssh, _two(cluster, 1), "-x", "FROM_X=x value", "-x", "PASSED")
    argv += [str(SCRIPTS / "steps.py"), str(out), "2000", "0.05", *names]
    here = {"PASSED": "passed", "SECRET_HERE": "stays here", "NCCL_DEBUG": "INFO"}
    driver = _start(cluster, argv, log, cwd=job, env=here)
    try:
        _wait_for([out / "started-0", out / "started-1"], driver, log, timeout=100)
        seen_by_others = _command_lines_as_nobody(cluster)
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    text = log.read_text()
    assert driver.returncode == 130, text[-3000:]
    assert "manygpu: SIGINT: stopped the job on every host" in text
    # What any local user sees with ps: the job's processes (the driver, ssh,
    # every host's launcher and workers), and none of the values sent to the
    # hosts (-x by name, .manygpu_env, forwarded NCCL_*) nor the job secret.
    # (The driver's own argv holds "-x FROM_X=x value": typed by the user.)
    job = [line for line in seen_by_others if "manygpu" in line or line.startswith("ssh")]
    assert sum("launch --driven" in line for line in job) >= 2, job
    assert any(line.startswith("ssh ") for line in job), job
    for value in ("file value", "passed", "WARN", "INFO", "MANYGPU_JOB_SECRET"):
        assert not [line for line in job if value in line], (value, job)
    assert not [line for line in job if re.search(r"[0-9a-f]{32}", line)], job
    assert re.search(r"^10\.213\.0\.[12]/1: rank 1 of 2 is training$", text, re.M), text[-2000:]
    assert not list(out.glob("done-*"))
    seen = {s["addr"]: s["env"] for s in (json.loads(p.read_text()) for p in out.glob("started-*"))}
    expected = {"FROM_FILE": "file value", "FROM_X": "x value", "PASSED": "passed"}
    assert seen[cluster.addresses[1]] == expected | {"NCCL_DEBUG": "WARN", "SECRET_HERE": None}
    # Host 0 runs here, in this environment, plus the same variables.
    assert seen[cluster.addresses[0]] == expected | {
        "NCCL_DEBUG": "WARN",
        "SECRET_HERE": "stays here",
    }


@pytest.mark.timeout(150)
def test_a_host_killed_mid_job_ends_the_job_everywhere(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    cluster, ssh = hosts
    log = tmp_path / "driver.log"
    out = tmp_path / "out"
    out.mkdir()
    driver = _start(
        cluster,
        [
            *_argv(cluster, ssh, _two(cluster, 1)),
            str(SCRIPTS / "steps.py"),
            str(out),
            "2000",
            "0.05",
        ],
        log,
    )
    try:
        _wait_for([out / "started-0", out / "started-1"], driver, log, timeout=100)
        assert cluster.kill_host(1)  # the machine dies: its sshd, launcher and worker
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    text = log.read_text()
    assert driver.returncode != 0, text[-3000:]
    report = _report(text)
    assert report and cluster.addresses[1] in report[0], text[-3000:]
    assert not list(out.glob("done-*"))


def _checkpoints(ckpt: Path) -> list[dict[str, Any]]:
    """Each committed checkpoint's meta, oldest first."""
    return [layout.read_meta(d) for d in layout.committed(ckpt)]


@pytest.mark.timeout(150)
def test_an_elastic_job_survives_a_killed_host(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    """``--nnodes 1:2``, one rank per host, checkpointing every 4 steps: host 1 crashes
    (every process on it dies) once the two hosts have saved; host 0's agent restarts
    its worker in a rendezvous round of one node, which resumes from the two hosts'
    checkpoint as a world of one and finishes."""
    cluster, ssh = hosts
    log, ckpt, out = tmp_path / "driver.log", tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    elastic = [
        "--nnodes",
        "1:2",
        "--max-restarts",
        "3",
        # The dead host drops out after 2 missed 1 s heartbeats (default 3 x 5 s).
        # The first round waits up to 10 s for the second host (it closes at
        # once when both are in): with 2 s a loaded machine started host 1's
        # launcher too late and the two never met in one round.
        "--rdzv-conf",
        "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=2",
    ]
    argv = [*_argv(cluster, ssh, _two(cluster, 1), *elastic), str(CKPT_SCRIPT)]
    # 32 steps of 0.1 s: host 1 dies near step 4 with ~3 s of the job left to run.
    driver = _start(cluster, [*argv, str(ckpt), str(out), str(STEPS), "4", "-1", "0.1"], log)
    try:
        deadline = time.monotonic() + 100
        while not _checkpoints(ckpt):
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert cluster.kill_host(1)
        driver.wait(timeout=100)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    text = log.read_text()
    assert driver.returncode == 0, text[-3000:]
    assert (
        f"manygpu: the elastic job finished without a host (lost host {cluster.addresses[1]}"
        in text
    )
    metas = _checkpoints(ckpt)
    assert (metas[-1]["world_size"], metas[-1]["step"]) == (1, STEPS), metas
    # Host 0 went on alone from a checkpoint the two hosts saved (world size 2).
    resumed = json.loads(sorted(out.glob("losses-*.json"))[-1].read_text())
    assert 4 <= min(int(s) for s in resumed) - 1 < STEPS, sorted(resumed)


@pytest.mark.timeout(150)
def test_a_hang_over_hosts_is_reported_first_as_its_verdict(
    hosts: tuple[EmulatedCluster, SshHosts], tmp_path: Path
) -> None:
    """Rank 1 (host 1) spins in save_checkpoint() while rank 0 waits: the driver's
    report starts with the verdict the store's host made, and the job exits 124."""
    cluster, ssh = hosts
    script = Path(__file__).resolve().parents[1] / "launch" / "scripts" / "hang_kinds.py"
    argv = _argv(cluster, ssh, _two(cluster, 1), "--timeout", "12", "--term-timeout", "3")
    res = _run(cluster, [*argv, str(script), "spin", str(tmp_path)], 120)
    assert res.returncode == 124, res.stderr[-3000:]
    report = _report(res.stderr)
    assert report[0] == (
        f"manygpu: {cluster.addresses[0]}: hang: rank 1 (host {cluster.addresses[1]}) never "
        "entered all_reduce #2 that rank 0 waits in; rank 1 is at hang_kinds.py:32 in "
        "save_checkpoint()"
    ), report
    assert all("(a consequence)" in line for line in report[1:]), report
