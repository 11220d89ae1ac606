"""A host dies mid-job: with --nnodes 1:2 the job goes on with the host left.

Two emulated hosts, one worker each, c10d rendezvous on host 0; host 1's
launcher and worker are SIGKILLed (a crashed machine). Host 0's agent restarts
its worker in a new rendezvous round of one node, which resumes from the
latest checkpoint with world size 1 and finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import subprocess_env

from manygpu.emulate import EmulatedCluster, LinkShape, netns_available

OK, WHY = netns_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "launch" / "scripts" / "ckpt_launch.py"
# At 0.1 s a step, host 1 is killed near step 8 with about 2.5 s of the job still to
# run: enough for the kill to land mid-job (it lands within a 0.2 s poll), not so much
# that the test waits for nothing (host 0 then runs the rest alone, at the same pace).
STEPS = 32


def _steps(ckpt: Path) -> list[int]:
    return [
        int(p.name.removeprefix("step-"))
        for p in ckpt.glob("step-*")
        if not p.name.endswith(".tmp")
    ]


@pytest.mark.timeout(400)
def test_job_survives_losing_a_host(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    outs = [tmp_path / f"host{i}" for i in range(2)]
    with EmulatedCluster(2, LinkShape(rate="1gbit")) as cluster:
        procs = []
        for i, out in enumerate(outs):
            out.mkdir()
            cmd = [
                sys.executable,
                "-m",
                "manygpu",
                "launch",
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "1",
                "--rdzv-endpoint",
                f"{cluster.addresses[0]}:29581",
                "--rdzv-id",
                "elastic-test",
                "--rdzv-conf",
                # The dead host drops out after 2 missed 1 s heartbeats (default 3 x 5 s).
                "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2",
                "--local-addr",
                cluster.addresses[i],
                "--max-restarts",
                "3",
                "--timeout",
                "60",
                str(SCRIPT),
                str(ckpt),
                str(out),
                str(STEPS),
                "4",
                "-1",
                "0.1",
            ]
            log = open(tmp_path / f"log{i}", "w")  # noqa: SIM115  (a pipe could fill and stall)
            procs.append(
                cluster.popen(
                    i,
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=subprocess_env(namespace=True),
                    start_new_session=True,
                )
            )
        try:
            deadline = time.monotonic() + 90
            while max(_steps(ckpt), default=0) < 6:
                assert time.monotonic() < deadline, (tmp_path / "log0").read_text()[-3000:]
                time.sleep(0.2)
            assert cluster.kill_host(1)  # host 1 crashes: every process on it dies
            procs[1].wait()
            procs[0].wait(timeout=240)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    assert procs[0].returncode == 0, (tmp_path / "log0").read_text()[-3000:]
    metas = [json.loads((d / "meta.json").read_text()) for d in sorted(ckpt.glob("step-*"))]
    assert metas[-1]["world_size"] == 1 and metas[-1]["step"] == STEPS
    resumed = json.loads(sorted(outs[0].glob("losses-*.json"))[-1].read_text())
    assert 6 <= min(int(s) for s in resumed) < STEPS  # went on from a 2-host checkpoint
