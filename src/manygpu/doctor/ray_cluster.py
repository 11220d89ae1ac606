"""What ``manygpu doctor --ray ADDRESS`` knows of a Ray cluster, and how it learns it.

:func:`probe` runs ``ray_nodes.py`` as a child Ray driver with a deadline (a
wrong address makes ``ray.init`` wait for minutes; a killed child cannot) and
:func:`interpret` turns what the child printed into a :class:`RayCluster`: pure,
so every outcome (no Ray here, no answer in time, no nodes, a node without Ray
Train) is tested without Ray. Checks over it: :mod:`manygpu.doctor.ray_checks`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manygpu.doctor.facts import from_dict

CHILD = Path(__file__).with_name("ray_nodes.py")
"""The child driver, run as a script: it imports nothing of manygpu."""
GRACE_S = 3.0
"""Seconds past the deadline the child gets to print what it has before it is killed."""


@dataclass
class NodeSoftware:
    """What a node's Python holds (a zero-CPU task pinned to the node asked it)."""

    ray: str | None = None
    train_error: str | None = None
    """Why ``import ray.train.torch`` failed there; None: it imports."""
    torch: str | None = None
    """torch's version; None: torch does not import there."""
    cuda_devices: int | None = None
    manygpu: str | None = None
    """manygpu's installed version; None: not installed there."""


@dataclass
class RayNode:
    """One node as the cluster's GCS lists it (``ray.nodes()``)."""

    node_id: str
    host: str = ""
    ip: str = ""
    alive: bool = True
    head: bool = False
    cpus: float = 0.0
    gpus: float = 0.0
    """GPUs Ray offers to tasks there (its ``GPU`` resource)."""
    memory_bytes: int | None = None
    """Memory Ray schedules there (its ``memory`` resource)."""
    accelerator: str | None = None
    """Ray's ``accelerator_type`` of the node's GPUs (``H100``...), when it set one."""
    software: NodeSoftware | None = None
    """None: the node did not answer in time."""


@dataclass
class RayCluster:
    """The cluster at ``address``, or why it could not be seen."""

    address: str
    timeout_s: float
    installed: bool = True
    """Whether Ray is installed in this Python (the driver's side)."""
    error: str | None = None
    """Why no node list came back (one line)."""
    timed_out: bool = False
    """The child driver was still waiting at the deadline."""
    ray: str | None = None
    """The Ray version this driver connected with (the cluster's: Ray refuses others)."""
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def alive(self) -> list[RayNode]:
        return [n for n in self.nodes if n.alive]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RayCluster:
        return from_dict(cls, data)


def probe(address: str, timeout_s: float) -> RayCluster:
    """The cluster at ``address`` (``HOST:PORT``, ``ray://...`` or ``auto``), within
    ``timeout_s`` seconds and a few more (never a hang)."""
    if importlib.util.find_spec("ray") is None:
        return RayCluster(address=address, timeout_s=timeout_s, installed=False)
    argv = [sys.executable, str(CHILD), address, f"{timeout_s:g}"]
    # Its own session: at the deadline the whole group goes, so nothing it started
    # keeps the pipes open and the read after the kill returns at once.
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = child.communicate(timeout=timeout_s + GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        return interpret(address, timeout_s, out, err, None)
    return interpret(address, timeout_s, out, err, child.returncode)


def interpret(
    address: str, timeout_s: float, stdout: str, stderr: str, returncode: int | None
) -> RayCluster:
    """What the child printed, checked by structure; ``returncode`` None: killed at the deadline."""
    cluster = RayCluster(address=address, timeout_s=timeout_s, timed_out=returncode is None)
    records = _records(stdout)
    listed = next((r for r in records if isinstance(r.get("nodes"), list)), None)
    said = next((r["error"] for r in records if isinstance(r.get("error"), str)), None)
    if listed is None:
        if said is not None:
            cluster.error = said
        elif returncode is None:
            cluster.error = f"no Ray cluster answered at {address} within {timeout_s:g}s"
        else:
            cluster.error = _last_line(stderr) or f"the Ray driver exited with code {returncode}"
        return cluster
    cluster.ray = listed.get("ray") if isinstance(listed.get("ray"), str) else None
    answers: dict[str, Any] = next(
        (r["software"] for r in records if isinstance(r.get("software"), dict)), {}
    )
    for raw in listed["nodes"]:
        if not isinstance(raw, dict) or not isinstance(raw.get("node_id"), str):
            continue
        node = from_dict(RayNode, {k: v for k, v in raw.items() if k != "software"})
        soft = answers.get(node.node_id)
        node.software = from_dict(NodeSoftware, soft) if isinstance(soft, dict) else None
        cluster.nodes.append(node)
    return cluster


def _records(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue  # Ray's own chatter
        if isinstance(value, dict):
            out.append(value)
    return out


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
