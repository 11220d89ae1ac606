"""``manygpu k8s render``: a ready-to-apply Kubeflow TrainJob or PyTorchJob for a manygpu job.

Building the parser imports nothing but :mod:`manygpu.k8s.render` (``re``, a
dataclass and the launch options' plain data), so ``manygpu --help`` stays cheap; PyYAML is imported
only when rendering, and only if it is there (JSON is valid YAML).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from manygpu.cli.parser import OneLineParser
from manygpu.errors import UsageError
from manygpu.k8s.render import KINDS, SECRET_KEY, RenderOptions, render

HELP = f"""Write a manifest that runs `manygpu launch SCRIPT ARGS` in every pod, with no
launch flags: in the pod manygpu reads the operator's PET_* variables. The
manifest sets what is easy to get wrong: /dev/shm in memory (--shm-size), a
termination grace period for the Checkpointer to save on SIGTERM, the GPUs as
request and limit, MANYGPU_JOB_SECRET from a Secret (create it first:
kubectl create secret generic NAME-job-secret --from-literal={SECRET_KEY}=$(openssl rand -hex 32)),
restartPolicy OnFailure (PyTorchJob; a TrainJob keeps its runtime's), and a
preflight `manygpu doctor --json` of each pod alone (the single-node doctor:
--all-ranks needs a running job), which fails the pod before training starts:
a PyTorchJob's init container; in a TrainJob, whose API cannot add one, the
trainer container runs it before exec'ing manygpu launch.

  manygpu k8s render --image IMG --nnodes 2 --gpus-per-pod 8 -- python train.py --lr 0.1
  manygpu k8s render --kind pytorchjob --nnodes 2:4 --image IMG -o job.yaml -- train.py"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("k8s", help="write Kubernetes manifests (Kubeflow TrainJob / PyTorchJob)")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", parser_class=OneLineParser, required=True)
    r = verbs.add_parser(
        "render",
        help="a TrainJob or PyTorchJob manifest that runs manygpu launch",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    _job_options(r)
    _pod_options(r)
    r.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    # Not dest "command": main.py names the subcommand by ns.command in its errors.
    r.add_argument(
        "user_command",
        nargs="*",
        metavar="-- COMMAND",
        help="the training command, e.g. -- python train.py --lr 0.1",
    )
    r.set_defaults(run=run_render)


def _job_options(r: argparse.ArgumentParser) -> None:
    """What the job is: its kind, image, name, size."""
    r.add_argument(
        "--kind",
        choices=KINDS,
        default="trainjob",
        help="trainjob: Kubeflow Trainer v2 (default); pytorchjob: training-operator v1",
    )
    r.add_argument("--image", required=True, help="the container image (with manygpu installed)")
    r.add_argument("--name", default="manygpu-job", help="the job's name (default manygpu-job)")
    r.add_argument(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="pods (default 1); a range MIN:MAX is PyTorchJob's elastic policy",
    )
    r.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        metavar="K|auto",
        help="processes per pod (default: --gpus-per-pod, or auto on CPU pods)",
    )
    r.add_argument(
        "--runtime",
        default="torch-distributed",
        help="TrainJob: the ClusterTrainingRuntime (default torch-distributed)",
    )


def _pod_options(r: argparse.ArgumentParser) -> None:
    """What each pod gets: GPUs, the secret, the grace period, /dev/shm, the preflight."""
    r.add_argument(
        "--gpus-per-pod",
        type=int,
        default=0,
        help="nvidia.com/gpu requested and limited per pod (default 0: CPU pods)",
    )
    r.add_argument(
        "--secret-name",
        help="the Secret holding the job secret under key "
        f"'{SECRET_KEY}' (default <name>-job-secret)",
    )
    r.add_argument(
        "--termination-grace-s",
        type=int,
        default=120,
        help="seconds from SIGTERM to SIGKILL, for the last checkpoint (default 120)",
    )
    r.add_argument("--shm-size", default="8Gi", help="/dev/shm size, in memory (default 8Gi)")
    r.add_argument(
        "--preflight",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run manygpu doctor --json in each pod before training (default on)",
    )


def dump(manifest: dict[str, Any]) -> str:
    """YAML if PyYAML is importable, else JSON (which is YAML too)."""
    try:
        import yaml
    except ImportError:
        return json.dumps(manifest, indent=2) + "\n"

    class NoAliases(yaml.SafeDumper):
        """Every node written out: ``&id001`` anchors confuse people reading a manifest."""

        def ignore_aliases(self, data: Any) -> bool:
            return True

    return str(yaml.dump(manifest, Dumper=NoAliases, sort_keys=False, width=100))


def run_render(ns: argparse.Namespace) -> int:
    command = list(ns.user_command)
    if command[:1] == ["--"]:
        command = command[1:]
    opts = RenderOptions(
        name=ns.name,
        image=ns.image,
        command=tuple(command),
        kind=ns.kind,
        nnodes=ns.nnodes,
        nproc_per_node=ns.nproc_per_node,
        gpus_per_pod=ns.gpus_per_pod,
        secret_name=ns.secret_name,
        termination_grace_s=ns.termination_grace_s,
        shm_size=ns.shm_size,
        preflight=ns.preflight,
        runtime=ns.runtime,
    )
    text = dump(render(opts))
    if ns.output in (None, "-"):
        sys.stdout.write(text)
        return 0
    try:
        Path(ns.output).write_text(text)
    except OSError as exc:
        raise UsageError(f"--output {ns.output}: {exc.strerror or exc}") from exc
    return 0
