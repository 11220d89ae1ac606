"""The child process of ``manygpu doctor --ray``: a Ray driver that lists the cluster's nodes.

Run as a script (``python ray_nodes.py ADDRESS TIMEOUT_S``), never imported by
the doctor: connecting to Ray can wait for minutes on a wrong address, and a
process can be killed at a deadline where a thread cannot. It imports nothing
of manygpu (the parent reads its output), connects with ``ray.init``, prints
one JSON line with the nodes Ray knows (``{"nodes": [...], "ray": VERSION}``),
then asks every alive node, by a zero-CPU task pinned to it, what its Python
holds (Ray, Ray Train, torch, manygpu, CUDA devices) and prints
``{"software": {NODE_ID: {...}}}`` with the answers that came within the time
left. A failure to connect is one line: ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


def _say(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)  # flushed: the parent may kill us at its deadline


def _software() -> dict[str, Any]:
    """What this node's Python holds (runs on the node, as a Ray task)."""
    import importlib.metadata

    import ray

    out: dict[str, Any] = {"ray": ray.__version__, "train_error": None}
    try:
        import ray.train.torch
    except Exception as exc:  # a missing extra's package, or a broken one
        out["train_error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    try:
        import torch

        out["torch"], out["cuda_devices"] = torch.__version__, torch.cuda.device_count()
    except Exception:
        out["torch"], out["cuda_devices"] = None, None
    try:
        out["manygpu"] = importlib.metadata.version("manygpu")
    except importlib.metadata.PackageNotFoundError:
        out["manygpu"] = None
    return out


def _node(raw: dict[str, Any]) -> dict[str, Any]:
    resources = raw.get("Resources") or {}
    kinds = [k.partition(":")[2] for k in resources if k.startswith("accelerator_type:")]
    return {
        "node_id": raw.get("NodeID", ""),
        "host": raw.get("NodeManagerHostname", ""),
        "ip": raw.get("NodeManagerAddress", ""),
        "alive": bool(raw.get("Alive")),
        "head": "node:__internal_head__" in resources,
        "cpus": float(resources.get("CPU", 0)),
        "gpus": float(resources.get("GPU", 0)),
        "memory_bytes": int(resources.get("memory", 0)) or None,
        "accelerator": kinds[0] if kinds else None,
    }


def main(address: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        _say({"error": f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")})
        return 2
    nodes = [_node(n) for n in ray.nodes()]
    _say({"nodes": nodes, "ray": ray.__version__})
    ask = ray.remote(num_cpus=0, max_retries=0)(_software)
    pending = {
        ask.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["node_id"], soft=False)
        ).remote(): n["node_id"]
        for n in nodes
        if n["alive"]
    }
    done, _ = ray.wait(list(pending), num_returns=len(pending),
                       timeout=max(deadline - time.monotonic() - 1, 0.1))  # fmt: skip
    answers = {}
    for ref in done:
        try:
            answers[pending[ref]] = ray.get(ref)
        except Exception:  # the node died meanwhile: no answer, like a late one
            continue
    _say({"software": answers})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
