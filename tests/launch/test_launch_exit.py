"""A launcher exits with its job's exit code, at once, whatever happens at the end.

Whatever its hang watch is doing: the watch (a daemon thread) calls the job's
store. One that came back from a store call while the interpreter finalized
aborted the launcher after a good job (SIGABRT, "terminate called without an
active exception"); see scripts/watch_in_store_call.py, which puts the watch in
a store call as the job ends, every time. And whatever another node's launcher
did: one whose rank failed counts itself out of torch's exit barrier, where a
node that finished waits for every node (launch/exit_barrier.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
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


FAILS_AFTER_THE_LAST_COLLECTIVE = """\
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
if os.environ["GROUP_RANK"] == "1":
    sys.exit(3)
"""


def test_a_node_that_finished_does_not_wait_for_a_node_that_failed(tmp_path: Path) -> None:
    """Two nodes (a launcher each, on loopback), a rank each: node 1's rank exits 3 after
    the job's last collective, node 0's succeeds. Node 0's launcher ends with 0 as soon
    as node 1's has ended (torch's exit barrier held it 300 s), node 1's with 3."""
    script = tmp_path / "job.py"
    script.write_text(FAILS_AFTER_THE_LAST_COLLECTIVE)
    port = str(free_port())

    def node(n: int) -> subprocess.Popen[str]:
        argv = ["launch", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", port, str(script)]  # fmt: skip
        return subprocess.Popen([sys.executable, "-m", "manygpu", *argv], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=subprocess_env())  # fmt: skip

    procs = [node(0), node(1)]
    ended: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 150
        while len(ended) < 2 and time.monotonic() < deadline:
            for n, proc in enumerate(procs):
                if n not in ended and proc.poll() is not None:
                    ended[n] = time.monotonic()
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        said = [proc.communicate()[1] for proc in procs]
    assert 1 in ended and procs[1].returncode == 3, said[1][-3000:]
    assert "rank 1 failed with exit code 3" in said[1], said[1][-3000:]
    assert 0 in ended, f"node 0's launcher still waited {time.monotonic() - ended[1]:.0f} s after"
    assert procs[0].returncode == 0, said[0][-3000:]
    assert ended[0] - ended[1] < 60, f"node 0 ended {ended[0] - ended[1]:.0f} s after node 1"
