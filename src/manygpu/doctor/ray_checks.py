"""Checks of a Ray cluster (``manygpu doctor --ray``): pure functions of a :class:`RayCluster`.

Each finding is one line with its fix, as the machine checks are: Ray missing
here, a cluster that did not answer in time, no alive node, dead nodes, a Ray
other than the one ``manygpu[ray]`` pins, a node whose Python cannot import
Ray Train, torch or manygpu, a node whose GPU count Ray and torch disagree on.
"""

from __future__ import annotations

from manygpu.doctor.ray_cluster import RayCluster, RayNode
from manygpu.doctor.result import CheckResult, fail, ok, warn
from manygpu.runtime.ray_train import RAY_VERSION

EXTRA = "pip install 'manygpu[ray]'"


def check_ray(cluster: RayCluster, pin: str = RAY_VERSION) -> list[CheckResult]:
    """Every finding about ``cluster``; ``pin``: the Ray release the extra pins."""
    if not cluster.installed:
        return [fail("ray", "Ray is not installed here", f"{EXTRA} (Ray Train {pin})")]
    if cluster.error is not None:
        return [_unreachable(cluster)]
    alive = cluster.alive
    if not alive:
        return [
            fail(
                "ray",
                f"the Ray cluster at {cluster.address} has no alive node",
                "start its nodes (ray start --head, then ray start --address HEAD:6379)",
            )
        ]
    out = [_summary(cluster, alive)]
    dead = [n for n in cluster.nodes if not n.alive]
    if dead:
        out.append(
            warn(
                "ray nodes",
                f"{len(dead)} node(s) listed dead: {_names(dead)}",
                "Ray Train schedules on alive nodes only; restart them if the job needs them",
            )
        )
    out += _versions(cluster, alive, pin)
    for node in alive:
        out += _node_checks(node, cluster.timeout_s)
    return out


def _unreachable(cluster: RayCluster) -> CheckResult:
    if cluster.timed_out:
        fix = (
            "check the address (the head's HOST:6379, or auto on a node of the cluster), "
            "that the port is open from here, and RAY_AUTH_TOKEN when the cluster needs one"
        )
    else:
        fix = "start a cluster (ray start --head) or give its head's HOST:6379"
    return fail("ray", f"cannot reach the Ray cluster at {cluster.address}: {cluster.error}", fix)


def _summary(cluster: RayCluster, alive: list[RayNode]) -> CheckResult:
    cpus, gpus = sum(n.cpus for n in alive), sum(n.gpus for n in alive)
    where = "" if gpus else " (no GPU: TorchTrainer with use_gpu=False, gloo)"
    return ok(
        "ray",
        f"{len(alive)} node(s) alive at {cluster.address}: {cpus:g} CPUs, {gpus:g} GPUs{where}",
    )


def _versions(cluster: RayCluster, alive: list[RayNode], pin: str) -> list[CheckResult]:
    """Ray refuses a node or a driver of another version than the head's, so one
    version runs the cluster: this driver's, or a node's that says otherwise."""
    seen: dict[str, list[str]] = {}
    if cluster.ray is not None:
        seen.setdefault(cluster.ray, []).append("this driver")
    for node in alive:
        if node.software is not None and node.software.ray is not None:
            seen.setdefault(node.software.ray, []).append(node.ip or node.node_id[:8])
    other = {v: where for v, where in seen.items() if v != pin}
    return [
        warn(
            "ray version",
            f"Ray {version} on {', '.join(where)}: manygpu[ray] is tested with Ray {pin}",
            f"{EXTRA} on every node and here (Ray {pin})",
        )
        for version, where in sorted(other.items())
    ]


def _node_checks(node: RayNode, timeout_s: float) -> list[CheckResult]:
    name = node.ip or node.host or node.node_id[:8]
    soft = node.software
    if soft is None:
        return [
            warn(
                "ray node",
                f"node {name} did not answer within {timeout_s:g}s: its software is unknown",
                "rerun with a larger --op-timeout; a node too busy to start a worker is slow "
                "to start training workers too",
            )
        ]
    out = []
    if soft.train_error is not None:
        out.append(
            fail(
                "ray train",
                f"node {name} cannot import ray.train.torch: {soft.train_error}",
                f"{EXTRA} in the Python that node's Ray runs",
            )
        )
    if soft.torch is None:
        out.append(fail("ray node", f"node {name} has no torch", "install torch on that node"))
    if soft.manygpu is None:
        out.append(
            warn(
                "ray node",
                f"node {name} has no manygpu installed: the training loop imports it",
                "pip install manygpu there, or ship it with the job's runtime_env",
            )
        )
    if soft.cuda_devices is not None and soft.cuda_devices != int(node.gpus):
        out.append(
            warn(
                "ray gpus",
                f"node {name}: Ray offers {node.gpus:g} GPU(s), torch sees {soft.cuda_devices}",
                f"start that node with ray start --num-gpus {soft.cuda_devices}, or fix "
                "CUDA_VISIBLE_DEVICES in its environment",
            )
        )
    return out


def _names(nodes: list[RayNode]) -> str:
    return ", ".join(n.ip or n.host or n.node_id[:8] for n in nodes)
