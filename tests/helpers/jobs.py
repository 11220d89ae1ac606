"""What tests need to start jobs: the environment of a launched process, a fake cluster."""

from __future__ import annotations

import os
from pathlib import Path

from manygpu.runtime.cluster import ClusterInfo

ROOT = Path(__file__).resolve().parents[2]


JOB_SECRET = "tests-job-secret-5f0c1e9a7b3d42c8"
"""The secret the emulated hosts of a test job share."""


def subprocess_env(*, namespace: bool = False) -> dict[str, str]:
    """This environment plus the project's sources and test helpers on PYTHONPATH.

    ``namespace=True`` is for emulated hosts: gloo on the namespace's own
    ``eth0`` (never loopback), one thread per process, and the job secret
    every node of a job that meets over the network must share (as a user
    exports it on every node).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "helpers")])
    if namespace:
        env |= {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        env["MANYGPU_JOB_SECRET"] = JOB_SECRET
    return env


def two_rank_cluster() -> ClusterInfo:
    """Rank 0 of a 2-process job on one node (to test world-size validation)."""
    return ClusterInfo(
        source="env",
        rank=0,
        world_size=2,
        local_rank=0,
        local_world_size=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
    )
