"""``manygpu k8s render``: manifests valid by the operators' CRDs, with the defaults set.

The CRD schemas (tests/data/k8s) leave unknown fields open, and an API server
silently prunes them; the validator here closes every object that lists its
properties, so a field the CRD does not know fails the test instead.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

from manygpu.cli.k8s import dump  # noqa: E402
from manygpu.cli.main import main  # noqa: E402
from manygpu.errors import UsageError  # noqa: E402
from manygpu.k8s.render import RenderOptions, render  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
CMD = ("python", "train.py", "--lr", "0.1")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever properties are listed."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    open_ = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_:
        out["additionalProperties"] = False
    return out


def validator(kind: str) -> Any:
    name = {"trainjob": "trainjob.v1alpha1", "pytorchjob": "pytorchjob.v1"}[kind]
    schema = json.loads((DATA / f"{name}.schema.json").read_text())
    return jsonschema.Draft7Validator(closed(schema))


def valid(manifest: dict[str, Any], kind: str) -> dict[str, Any]:
    errors = [
        f"{list(e.absolute_path)}: {e.message}" for e in validator(kind).iter_errors(manifest)
    ]
    assert not errors, errors
    return manifest


def opts(**kw: Any) -> RenderOptions:
    base: dict[str, Any] = {"name": "llm", "image": "ghcr.io/me/train:1", "command": CMD}
    return RenderOptions(**(base | kw))


def test_the_validator_catches_a_field_the_crd_would_prune() -> None:
    m = render(opts())
    m["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"
    ]["spec"]["template"]["spec"]["initContainers"] = [{"name": "x", "image": "y"}]
    assert list(validator("trainjob").iter_errors(m))


def test_trainjob_defaults() -> None:
    m = valid(render(opts(nnodes="2")), "trainjob")
    assert (m["apiVersion"], m["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    spec = m["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed"}
    t = spec["trainer"]
    assert t["image"] == "ghcr.io/me/train:1" and t["numNodes"] == 2
    assert "numProcPerNode" not in t and "resourcesPerNode" not in t  # CPU pods: auto
    assert t["args"] == ["train.py", "--lr", "0.1"]
    # Preflight: the single-node doctor, then exec manygpu launch with no flags.
    sh, dash_c, script, argv0 = t["command"]
    assert (sh, dash_c) == ("sh", "-c") and argv0
    words = shlex.split(script)
    assert words[words.index("manygpu") :] == [
        "manygpu", "doctor", "--json", "&&", "exec", "manygpu", "launch", "$@",
    ]  # fmt: skip
    assert "--all-ranks" not in words and "PET_NODE_RANK" in words
    ref = t["env"][0]["valueFrom"]["secretKeyRef"]
    assert t["env"][0]["name"] == "MANYGPU_JOB_SECRET"
    assert ref == {"name": "llm-job-secret", "key": "secret"}  # required: two nodes
    job = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert job["name"] == "node"
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120
    assert pod["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    ]
    assert pod["containers"] == [
        {"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    ]


def test_trainjob_gpus_and_options() -> None:
    m = render(
        opts(
            nnodes="4",
            gpus_per_pod=8,
            preflight=False,
            runtime="my-torch",
            secret_name="shared.secret",
            termination_grace_s=600,
            shm_size="32Gi",
        )
    )
    t = valid(m, "trainjob")["spec"]["trainer"]
    assert t["command"] == ["manygpu", "launch"]
    assert t["numProcPerNode"] == 8
    gpus = {"nvidia.com/gpu": 8}
    assert t["resourcesPerNode"] == {"requests": gpus, "limits": gpus}
    assert t["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "shared.secret"
    assert m["spec"]["runtimeRef"]["name"] == "my-torch"
    pod = m["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ][0]["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 600
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "32Gi"
    t2 = render(opts(nproc_per_node="2", gpus_per_pod=8))["spec"]["trainer"]
    assert t2["numProcPerNode"] == 2


def test_pytorchjob_static() -> None:
    m = valid(render(opts(kind="pytorchjob", nnodes="3", gpus_per_pod=8)), "pytorchjob")
    assert (m["apiVersion"], m["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = m["spec"]
    assert spec["nprocPerNode"] == "8" and "elasticPolicy" not in spec
    replicas = spec["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 2}
    gpus = {"nvidia.com/gpu": 8}
    for r in replicas.values():
        assert r["restartPolicy"] == "OnFailure"
        pod = r["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 120
        assert pod["volumes"] == [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
        ]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch"  # the only container the operator gives PET_* to
        assert c["command"] == ["manygpu", "launch"]
        assert c["args"] == ["train.py", "--lr", "0.1"]
        assert c["resources"] == {"requests": gpus, "limits": gpus}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert c["env"][0]["valueFrom"]["secretKeyRef"] == {
            "name": "llm-job-secret",
            "key": "secret",
        }
        (init,) = pod["initContainers"]
        assert init["command"] == ["manygpu", "doctor", "--json"]
        assert init["image"] == c["image"] and init["resources"] == c["resources"]
        assert init["volumeMounts"] == c["volumeMounts"]
    # Built from one pod dict, handed out as separate ones.
    replicas["Master"]["template"]["spec"]["containers"][0]["image"] = "other"
    assert replicas["Worker"]["template"]["spec"]["containers"][0]["image"] != "other"


def test_pytorchjob_one_node_cpu_no_preflight() -> None:
    m = valid(render(opts(kind="pytorchjob", preflight=False)), "pytorchjob")
    spec = m["spec"]
    assert spec["nprocPerNode"] == "auto"
    assert list(spec["pytorchReplicaSpecs"]) == ["Master"]
    pod = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "initContainers" not in pod and "resources" not in pod["containers"][0]
    assert pod["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["optional"] is True


def test_pytorchjob_elastic() -> None:
    m = valid(render(opts(kind="pytorchjob", nnodes="2:4")), "pytorchjob")
    spec = m["spec"]
    assert spec["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4, "rdzvBackend": "c10d"}
    assert list(spec["pytorchReplicaSpecs"]) == ["Worker"]
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4


@pytest.mark.parametrize(
    ("command", "args"),
    [
        (("python3", "-m", "pkg.train", "--x", "1"), ["-m", "pkg.train", "--x", "1"]),
        (("/usr/bin/python3.11", "t.py"), ["t.py"]),
        (("t.py", "--", "a"), ["t.py", "--", "a"]),
    ],
)
def test_the_user_command_becomes_launch_args(command: tuple[str, ...], args: list[str]) -> None:
    assert render(opts(command=command, preflight=False))["spec"]["trainer"]["args"] == args


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"nnodes": "2:4"}, "--kind pytorchjob"),
        ({"nnodes": "4:2", "kind": "pytorchjob"}, "MIN is above MAX"),
        ({"nnodes": "0"}, "--nnodes 0"),
        ({"nnodes": "x"}, "--nnodes x"),
        ({"name": "My_Job"}, "--name"),
        ({"name": "9lives"}, "--name"),
        ({"name": "a" * 60}, "--name"),
        ({"image": ""}, "--image"),
        ({"secret_name": "Bad Secret"}, "--secret-name"),
        ({"shm_size": "lots"}, "--shm-size"),
        ({"shm_size": "0Gi"}, "--shm-size"),
        ({"termination_grace_s": -1}, "--termination-grace-s"),
        ({"gpus_per_pod": -1}, "--gpus-per-pod"),
        ({"nproc_per_node": "0"}, "--nproc-per-node"),
        ({"kind": "tfjob"}, "--kind"),
        ({"command": ()}, "after --"),
        ({"command": ("python",)}, "after --"),
        ({"command": ("python", "-u", "t.py")}, "option -u"),
        ({"command": ("python", "-m")}, "-m needs"),
        ({"command": ("manygpu", "launch", "t.py")}, "not manygpu"),
        ({"command": ("torchrun", "t.py")}, "not torchrun"),
    ],
)
def test_bad_input_is_one_line(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(UsageError, match=None) as info:
        render(opts(**kw))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_cli_writes_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.yaml"
    argv = ["k8s", "render", "--kind", "pytorchjob", "--image", "img:1", "--nnodes", "2"]
    assert main([*argv, "--gpus-per-pod", "4", "-o", str(out), "--", *CMD]) == 0
    m = valid(yaml.safe_load(out.read_text()), "pytorchjob")
    assert "&id" not in out.read_text()  # no YAML anchors for shared dicts
    assert m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "args"
    ] == ["train.py", "--lr", "0.1"]
    assert main(["k8s", "render", "--image", "img:1", "--", "train.py"]) == 0
    valid(yaml.safe_load(capsys.readouterr().out), "trainjob")


def test_cli_bad_input_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k8s", "render", "--image", "img", "--nnodes", "1:2", "--", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("manygpu k8s: error: --nnodes 1:2") and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        main(["k8s", "render", "--", "t.py"])  # --image is required
    assert exit_.value.code == 2


def test_json_without_pyyaml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml -> ImportError
    manifest = render(opts())
    assert json.loads(dump(manifest)) == manifest
