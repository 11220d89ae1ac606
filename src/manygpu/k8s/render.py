"""A Kubeflow manifest for a manygpu job: options in, a dict ready to dump as YAML out.

Pure: no Kubernetes client, no file access, nothing heavier than ``re``. The
container runs ``manygpu launch SCRIPT ARGS`` with no launch flags, because
inside the pod manygpu reads the operator's ``PET_*`` variables itself
(:mod:`manygpu.launch.engines`); flags baked into a manifest would only drift
from what the operator decides. What the manifest does set are the defaults
people get wrong by hand: a memory-backed ``/dev/shm`` (the container runtime's
64 MiB one breaks DataLoader workers and NCCL's shared-memory transport), a
termination grace period long enough for the Checkpointer to save on SIGTERM,
the GPUs as both request and limit, the job secret from a Kubernetes Secret, and
a preflight ``manygpu doctor --json`` that fails the pod before training starts.

Checked against the CRDs in ``tests/data/k8s`` (Trainer v2.3.0's TrainJob
``v1alpha1``, training-operator v1.9's PyTorchJob ``v1``). What TrainJob
``v1alpha1`` cannot express:

- A new init container. Its pod-level settings go through
  ``spec.runtimePatches[].trainingRuntimeSpec`` (v2.0's ``podSpecOverrides`` and
  v2.1's ``podTemplateOverrides`` are gone), whose containers and init
  containers may only patch ``env``, ``volumeMounts`` and ``securityContext``
  of those the runtime already has, by name: no image, command or resources.
  So the preflight runs in the trainer container itself, before an ``exec`` of
  ``manygpu launch`` (``sh -c``), with the engine's variables unset so the
  doctor tests this pod alone; a failure exits before training starts.
- A restart policy or backoff limit: the patch reaches only the pod template
  of the runtime's ``node`` job, so the runtime's (JobSet's) policy stays.
- ``numProcPerNode: auto``: the field is an integer; "auto" leaves it out, and
  the torch runtime's default is auto.
- An elastic node range (``--nnodes MIN:MAX``): ``numNodes`` is one number.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from manygpu.errors import UsageError
from manygpu.launch.spec import parse_nnodes
from manygpu.runtime.env import JOB_SECRET

KINDS = ("trainjob", "pytorchjob")
SECRET_KEY = "secret"
"""The key in the Secret: ``kubectl create secret generic NAME --from-literal=secret=...``."""
SHM_VOLUME = "dshm"
PREFLIGHT = ("manygpu", "doctor", "--json")
"""The single-node doctor: ``--all-ranks`` needs a running job, which an init container is not."""
PATCH_MANAGER = "manygpu"
TRAINJOB_NODE = "node"
"""The replicated job and container of the torch runtimes (``torch-distributed``)."""
PYTORCHJOB_CONTAINER = "pytorch"
"""The only container training-operator v1 injects ``PET_*`` into."""
ENGINE_VARS = (
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_NPROC_PER_NODE",
    "JOB_COMPLETION_INDEX",
)
"""Unset for the in-container preflight, so the doctor does not join the job's rendezvous."""

_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^(\d+(\.\d+)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_PYTHON = re.compile(r"^(.*/)?python(3(\.\d+)?)?$")


@dataclass(frozen=True)
class RenderOptions:
    """What ``manygpu k8s render`` was asked for; :func:`render` checks it."""

    name: str
    image: str
    command: tuple[str, ...]
    """The user's command: ``python train.py --lr 0.1``, ``train.py ...`` or ``python -m pkg``."""
    kind: str = "trainjob"
    nnodes: str = "1"
    """``N``, or ``MIN:MAX`` (PyTorchJob's elastic policy only)."""
    nproc_per_node: str | None = None
    """An integer or ``auto``; ``None``: the GPUs per pod, else ``auto``."""
    gpus_per_pod: int = 0
    secret_name: str | None = None
    """``None``: ``<name>-job-secret``."""
    termination_grace_s: int = 120
    shm_size: str = "8Gi"
    preflight: bool = True
    runtime: str = "torch-distributed"


def launch_args(command: tuple[str, ...]) -> list[str]:
    """The arguments of ``manygpu launch`` for the user's command: its script (or ``-m
    module``) and the script's arguments, without the ``python`` in front."""
    rest = list(command)
    if rest and _PYTHON.match(rest[0]):
        rest = rest[1:]
    if not rest:
        raise UsageError("give the training command after --, e.g. -- python train.py --lr 0.1")
    first = rest[0]
    if first in ("manygpu", "torchrun"):
        raise UsageError(f"give the script after --, not {first}: the manifest runs manygpu launch")
    if first == "-m" and len(rest) < 2:
        raise UsageError("-m needs a module name, e.g. -- python -m pkg.train")
    if first.startswith("-") and first != "-m":
        raise UsageError(
            f"the command starts with option {first}: give the script (or -m module)"
            " first; manygpu launch takes no flags in the pod"
        )
    return rest


def _check(opts: RenderOptions, nodes: tuple[int, int]) -> None:
    """One line for the first thing wrong with ``opts`` (besides the node count and command)."""
    if opts.kind not in KINDS:
        raise UsageError(f"--kind {opts.kind}: choose one of {', '.join(KINDS)}")
    # Pods and Services are named after the job, and a Service name is a DNS-1035 label.
    suffix = f"-worker-{nodes[1] - 1}" if opts.kind == "pytorchjob" else f"-node-0-{nodes[1] - 1}"
    longest = 63 - len(suffix)
    if not _LABEL.match(opts.name) or len(opts.name) > longest:
        raise UsageError(
            f"--name {opts.name!r}: lower-case letters, digits and '-', starting with "
            f"a letter, at most {longest} characters (pods add {suffix!r})"
        )
    if not opts.image.strip() or any(c.isspace() for c in opts.image):
        raise UsageError(f"--image {opts.image!r}: give the image, e.g. ghcr.io/me/train:1")
    secret = opts.secret_name
    if secret is not None and (not _SUBDOMAIN.match(secret) or len(secret) > 253):
        raise UsageError(f"--secret-name {secret!r}: not a Kubernetes object name (DNS-1123)")
    if not _SUBDOMAIN.match(opts.runtime) or len(opts.runtime) > 253:
        raise UsageError(f"--runtime {opts.runtime!r}: not a runtime name (DNS-1123)")
    if opts.gpus_per_pod < 0:
        raise UsageError(f"--gpus-per-pod {opts.gpus_per_pod}: give 0 (CPU pods) or more")
    if opts.termination_grace_s < 0:
        raise UsageError(f"--termination-grace-s {opts.termination_grace_s}: give 0 or more")
    if not _QUANTITY.match(opts.shm_size) or float(re.sub(r"[A-Za-z]+$", "", opts.shm_size)) <= 0:
        raise UsageError(f"--shm-size {opts.shm_size!r}: give a positive quantity, e.g. 8Gi")
    if opts.kind == "trainjob" and nodes[0] != nodes[1]:
        raise UsageError(
            f"--nnodes {opts.nnodes}: a TrainJob runs a fixed number of nodes; "
            "give N, or use --kind pytorchjob for an elastic range"
        )


def _nproc(opts: RenderOptions) -> str:
    """``auto`` or a positive integer, as text; the default is the GPUs per pod."""
    value = opts.nproc_per_node
    if value is None:
        return str(opts.gpus_per_pod) if opts.gpus_per_pod > 0 else "auto"
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise UsageError(f"--nproc-per-node {value}: give a positive integer or auto")
    return value


def _resources(gpus: int) -> dict[str, Any]:
    """GPUs as request and limit (the device plugin needs the limit); nothing for CPU pods."""
    if gpus <= 0:
        return {}
    return {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}


def _secret_env(opts: RenderOptions, multi: bool) -> dict[str, Any]:
    """``MANYGPU_JOB_SECRET`` from the Secret; optional for one node, which needs none."""
    ref: dict[str, Any] = {"name": opts.secret_name or f"{opts.name}-job-secret", "key": SECRET_KEY}
    if not multi:
        ref["optional"] = True
    return {"name": JOB_SECRET, "valueFrom": {"secretKeyRef": ref}}


def _shm(opts: RenderOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount): ``/dev/shm`` in memory, capped (it counts against the pod's memory)."""
    volume = {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}}
    return volume, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


def _metadata(opts: RenderOptions) -> dict[str, Any]:
    return {"name": opts.name, "labels": {"app.kubernetes.io/managed-by": "manygpu"}}


def _preflight_shell() -> str:
    """``sh -c`` text: the single-node doctor, then ``exec manygpu launch "$@"``."""
    unset = " ".join(f"-u {name}" for name in ENGINE_VARS)
    return f'env {unset} {" ".join(PREFLIGHT)} && exec manygpu launch "$@"'


def render_trainjob(opts: RenderOptions, nodes: int, nproc: str, args: list[str]) -> dict[str, Any]:
    """A Trainer v2 ``TrainJob``; pod settings as a runtime patch of the ``node`` job."""
    trainer: dict[str, Any] = {"image": opts.image}
    if opts.preflight:
        trainer["command"] = ["sh", "-c", _preflight_shell(), "manygpu-preflight"]
    else:
        trainer["command"] = ["manygpu", "launch"]
    trainer["args"] = args
    trainer["numNodes"] = nodes
    if nproc != "auto":
        trainer["numProcPerNode"] = int(nproc)
    if opts.gpus_per_pod > 0:
        trainer["resourcesPerNode"] = _resources(opts.gpus_per_pod)
    trainer["env"] = [_secret_env(opts, nodes > 1)]
    volume, mount = _shm(opts)
    pod = {
        "terminationGracePeriodSeconds": opts.termination_grace_s,
        "volumes": [volume],
        "containers": [{"name": TRAINJOB_NODE, "volumeMounts": [mount]}],
    }
    job = {"name": TRAINJOB_NODE, "template": {"spec": {"template": {"spec": pod}}}}
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}},
    }
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": _metadata(opts),
        "spec": {
            "runtimeRef": {"name": opts.runtime},
            "trainer": trainer,
            "runtimePatches": [patch],
        },
    }


def render_pytorchjob(
    opts: RenderOptions, nodes: tuple[int, int], nproc: str, args: list[str]
) -> dict[str, Any]:
    """A training-operator v1 ``PyTorchJob``: Master + Workers, or elastic Workers only."""
    lo, hi = nodes
    volume, mount = _shm(opts)
    container: dict[str, Any] = {
        "name": PYTORCHJOB_CONTAINER,
        "image": opts.image,
        "command": ["manygpu", "launch"],
        "args": args,
        "env": [_secret_env(opts, hi > 1)],
        "volumeMounts": [mount],
    }
    resources = _resources(opts.gpus_per_pod)
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": opts.termination_grace_s}
    if opts.preflight:
        # Same GPUs and /dev/shm as the trainer, so the doctor checks what it will use;
        # an init container's request does not add to the pod's (max, not sum).
        init: dict[str, Any] = {
            "name": "manygpu-preflight",
            "image": opts.image,
            "command": list(PREFLIGHT),
            "volumeMounts": [dict(mount)],
        }
        if resources:
            init["resources"] = _resources(opts.gpus_per_pod)
        pod["initContainers"] = [init]
    pod["containers"] = [container]
    pod["volumes"] = [volume]

    def replicas(count: int) -> dict[str, Any]:
        # A copy each: a caller editing the Master must not edit the Workers (nor YAML alias them).
        template = {"spec": copy.deepcopy(pod)}
        return {"replicas": count, "restartPolicy": "OnFailure", "template": template}

    spec: dict[str, Any] = {"nprocPerNode": nproc}
    if lo != hi:
        # Elastic: Workers only (the operator points PET_RDZV_ENDPOINT at worker 0).
        spec["elasticPolicy"] = {"minReplicas": lo, "maxReplicas": hi, "rdzvBackend": "c10d"}
        spec["pytorchReplicaSpecs"] = {"Worker": replicas(hi)}
    else:
        spec["pytorchReplicaSpecs"] = {"Master": replicas(1)}
        if hi > 1:
            spec["pytorchReplicaSpecs"]["Worker"] = replicas(hi - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(opts),
        "spec": spec,
    }


def render(opts: RenderOptions) -> dict[str, Any]:
    """The manifest for ``opts``; a ``UsageError`` names the first bad option."""
    nodes = parse_nnodes(opts.nnodes)
    _check(opts, nodes)
    nproc = _nproc(opts)
    args = launch_args(opts.command)
    if opts.kind == "trainjob":
        return render_trainjob(opts, nodes[1], nproc, args)
    return render_pytorchjob(opts, nodes, nproc, args)
