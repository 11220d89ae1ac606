"""A launcher exits with its job's exit code, at once, whatever happens at the end.

Whatever its hang watch is doing: the watch (a daemon thread) calls the job's
store. One that came back from a store call while the interpreter finalized
aborted the launcher after a good job (SIGABRT, "terminate called without an
active exception"); see scripts/watch_in_store_call.py, which puts the watch in
a store call as the job ends, every time. And whatever another node's launcher
did: one whose rank failed counts itself out of torch's exit barrier, where a
node that finished waits for every node; one waiting there ends at once on
Ctrl-C (launch/exit_barrier.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dist_harness import free_port
from jobs import subprocess_env

SCRIPT = Path(__file__).parent / "scripts" / "watch_in_store_call.py"


@pytest.mark.parametrize(("job", "code"), [("print('done')", 0), ("raise SystemExit(3)", 3)])
def test_the_launcher_waits_for_its_watch_to_leave_the_store(
    tmp_path: Path, job: str, code: int
) -> None:
    script = tmp_path / "job.py"
    script.write_text(job + "\n")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "launch", "--nproc-per-node", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=subprocess_env(),
    )
    assert "the hang watch is in a store call" in res.stderr, res.stderr[-3000:]
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == code, res.stderr[-3000:]


AT_THE_END = """\
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

out, node = pathlib.Path(sys.argv[1]), os.environ["GROUP_RANK"]
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
(out / f"done{node}").touch()
if node == "2":  # the last node's rank fails late, after the job's last collective
    while not (out / "go").exists():
        time.sleep(0.1)
    sys.exit(3)
"""


def test_nodes_at_the_exit_barrier_end_on_ctrl_c_and_when_the_last_node_fails(
    tmp_path: Path,
) -> None:
    """Three nodes (a launcher each, on loopback), a rank each, all past the job's last
    collective: nodes 0 and 1 finished and wait for node 2 in torch's exit barrier.
    Ctrl-C ends node 1's launcher at once (torch's wait held it until the barrier
    opened); then node 2's rank exits 3, and node 0's launcher ends with 0 as soon as
    node 2's has (torch's barrier held it 300 s for a node that failed)."""
    script = tmp_path / "job.py"
    script.write_text(AT_THE_END)
    port = str(free_port())

    def node(n: int) -> subprocess.Popen[str]:
        argv = ["launch", "--nnodes", "3", "--node-rank", str(n), "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", port,
                str(script), str(tmp_path)]  # fmt: skip
        return subprocess.Popen([sys.executable, "-m", "manygpu", *argv], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=subprocess_env())  # fmt: skip

    procs = [node(n) for n in range(3)]
    ended: dict[int, float] = {}

    def until(what: str, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            for n, proc in enumerate(procs):
                if n not in ended and proc.poll() is not None:
                    ended[n] = time.monotonic()
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
            time.sleep(0.1)

    try:
        until("every rank done", lambda: len(list(tmp_path.glob("done*"))) == 3, 120)
        time.sleep(3)  # the agents of nodes 0 and 1 see their rank end: at the barrier
        procs[1].send_signal(signal.SIGINT)
        asked = time.monotonic()
        until("node 1 ended after Ctrl-C", lambda: 1 in ended, 30)
        assert ended[1] - asked < 10 and 0 not in ended and 2 not in ended, ended
        (tmp_path / "go").touch()
        until("nodes 0 and 2 ended", lambda: {0, 2} <= set(ended), 90)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        said = [proc.communicate()[1] for proc in procs]
    assert procs[1].returncode == 130, said[1][-3000:]
    assert procs[2].returncode == 3, said[2][-3000:]
    assert "rank 2 failed with exit code 3" in said[2], said[2][-3000:]
    assert procs[0].returncode == 0, said[0][-3000:]
    assert ended[0] - ended[2] < 30, f"node 0 ended {ended[0] - ended[2]:.0f} s after node 2"
