"""Launch options (plus Slurm's environment and the GPU count) -> LaunchSpec."""

from __future__ import annotations

import socket
import zlib
from pathlib import Path

import pytest

from manygpu.errors import UsageError
from manygpu.launch.netcheck import check_port_free, split_endpoint
from manygpu.launch.resolve import LaunchRequest, parse_gpus, resolve, threads_note
from manygpu.launch.spec import LaunchSpec
from manygpu.runtime.device import cpu_count

SLURM_PER_NODE = {
    "SLURM_JOB_ID": "98765",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _resolve(
    script: str, env: dict[str, str] | None = None, cuda: int = 0, **kw: object
) -> LaunchSpec:
    return resolve(LaunchRequest(entry=script, **kw), env or {}, cuda)  # type: ignore[arg-type]


def test_default_nproc_on_cpu_is_two(script: str) -> None:
    spec = _resolve(script, cuda=0)
    assert spec.nproc_per_node == 2
    assert spec.gpus is None and "CUDA_VISIBLE_DEVICES" not in spec.extra_env


def test_default_nproc_is_gpu_count(script: str) -> None:
    assert _resolve(script, cuda=4).nproc_per_node == 4


def test_gpus_sets_visible_devices_and_nproc(script: str) -> None:
    spec = _resolve(script, cuda=2, gpus="0,1")
    assert spec.nproc_per_node == 2
    assert spec.gpus == ("0", "1")
    assert spec.extra_env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_gpus_index_into_outer_visible_devices(script: str) -> None:
    assert parse_gpus("0,2", {"CUDA_VISIBLE_DEVICES": "3,5,7"}, 3) == ("3", "7")
    spec = _resolve(script, env={"CUDA_VISIBLE_DEVICES": "3,5,7"}, cuda=3, gpus="0,2")
    assert spec.extra_env["CUDA_VISIBLE_DEVICES"] == "3,7"


def test_gpus_all() -> None:
    assert parse_gpus("all", {}, 3) == ("0", "1", "2")


def test_gpus_all_without_gpus_says_so() -> None:
    with pytest.raises(UsageError, match="--gpus all: this machine has no CUDA GPU"):
        parse_gpus("all", {}, 0)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0,,1", "not a list of GPU indices"),
        ("a", "not a list of GPU indices"),
        ("-1", "not a list of GPU indices"),
        ("0,0", "names a GPU twice"),
    ],
)
def test_malformed_gpus(text: str, problem: str) -> None:
    with pytest.raises(UsageError, match=problem):
        parse_gpus(text, {}, 4)


@pytest.mark.parametrize(("cuda", "have"), [(0, "no CUDA GPU"), (2, "GPUs 0..1")])
def test_nonexistent_gpu(script: str, cuda: int, have: str) -> None:
    with pytest.raises(UsageError, match=f"names GPU 3 but this machine has {have}"):
        _resolve(script, cuda=cuda, gpus="3")


def test_zero_nproc_raises(script: str) -> None:
    with pytest.raises(UsageError, match="--nproc-per-node must be at least 1"):
        _resolve(script, nproc_per_node=0)


def test_missing_script_raises(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.py")
    with pytest.raises(UsageError, match="not found"):
        _resolve(missing)


def test_module_entry_needs_no_file() -> None:
    spec = resolve(LaunchRequest(entry="json.tool", is_module=True), {}, 0)
    assert spec.is_module and spec.entry == "json.tool"


def test_module_entry_must_be_importable() -> None:
    with pytest.raises(UsageError, match="module 'pkg_not_here' not found"):
        resolve(LaunchRequest(entry="pkg_not_here.train", is_module=True), {}, 0)


def test_multi_node_without_address_raises(script: str) -> None:
    with pytest.raises(UsageError, match="--master-addr"):
        _resolve(script, nnodes="2")


def test_multi_node_with_master_addr_is_static(script: str) -> None:
    spec = _resolve(script, nnodes="2", master_addr="host")
    assert (spec.min_nodes, spec.max_nodes) == (2, 2)
    assert spec.rdzv_backend == "static"
    assert spec.rdzv_endpoint == "host:29500"
    assert spec.node_rank == 0
    assert spec.local_addr is None  # other nodes must not be told 127.0.0.1


def test_ipv6_master_addr_is_bracketed(script: str) -> None:
    spec = _resolve(script, nnodes="2", master_addr="fd00::1", master_port=1234, node_rank=1)
    assert spec.rdzv_endpoint == "[fd00::1]:1234"
    assert spec.node_rank == 1


def test_single_node_default_is_standalone(script: str) -> None:
    spec = _resolve(script)
    assert (spec.rdzv_backend, spec.rdzv_endpoint) == ("c10d", "127.0.0.1:0")
    assert (spec.min_nodes, spec.max_nodes, spec.node_rank) == (1, 1, 0)
    assert spec.local_addr == "127.0.0.1"


def test_slurm_one_task_per_node(script: str) -> None:
    spec = _resolve(script, env=SLURM_PER_NODE)
    port = 20000 + zlib.crc32(b"98765.0") % 10000
    assert (spec.min_nodes, spec.max_nodes, spec.node_rank) == (2, 2, 1)
    assert spec.rdzv_endpoint == f"gpu07:{port}"
    assert spec.rdzv_id == "98765"


def test_srun_with_an_elastic_range_meets_where_slurm_says(script: str) -> None:
    """``srun manygpu launch --nnodes 1:2``: the range is the user's, the meeting point
    (the step's first node, the step's port) and each node's rank are Slurm's."""
    spec = _resolve(script, env=SLURM_PER_NODE, nnodes="1:2", max_restarts=2)
    port = 20000 + zlib.crc32(b"98765.0") % 10000
    assert (spec.min_nodes, spec.max_nodes, spec.node_rank) == (1, 2, 1)
    assert (spec.rdzv_backend, spec.rdzv_endpoint) == ("c10d", f"gpu07:{port}")
    with pytest.raises(UsageError, match="needs to know where to meet"):
        _resolve(script, env=SLURM_PER_NODE, nnodes="2")  # a fixed count given: flags only


def test_several_launchers_per_node_from_srun_are_refused_in_one_line(script: str) -> None:
    # srun started 8 launchers on 2 nodes (an allocation of 4 tasks per node exports
    # SLURM_NTASKS=8, which overrides srun --ntasks-per-node=1): each would run a job
    # of its own, silently. Refused, saying how to start one per node.
    with pytest.raises(UsageError) as err:
        _resolve(script, env=SLURM_PER_NODE | {"SLURM_NTASKS": "8"})
    text = str(err.value)
    assert "srun started 8 launchers on 2 node(s)" in text and "--ntasks=$SLURM_NNODES" in text
    assert "\n" not in text


def test_elastic_node_range(script: str) -> None:
    spec = _resolve(script, nnodes="1:4", rdzv_endpoint="head:29400")
    assert (spec.min_nodes, spec.max_nodes) == (1, 4)
    assert (spec.rdzv_backend, spec.rdzv_endpoint) == ("c10d", "head:29400")


@pytest.mark.parametrize("nnodes", ["x", "2:y", "4:2", "0"])
def test_bad_nnodes(script: str, nnodes: str) -> None:
    with pytest.raises(UsageError, match="--nnodes"):
        _resolve(script, nnodes=nnodes, master_addr="host")


def test_omp_threads_set_only_when_user_did_not(script: str) -> None:
    assert int(_resolve(script).extra_env["OMP_NUM_THREADS"]) >= 1
    spec = _resolve(script, env={"OMP_NUM_THREADS": "3"})
    assert "OMP_NUM_THREADS" not in spec.extra_env


def test_the_chosen_thread_count_is_said_and_only_when_chosen(script: str) -> None:
    spec = _resolve(script, nproc_per_node=2)
    threads = spec.extra_env["OMP_NUM_THREADS"]
    assert threads_note(spec) == (
        f"OMP_NUM_THREADS={threads} for each of the 2 workers on this node ({cpu_count()} "
        "CPUs split among them); set OMP_NUM_THREADS to choose"
    )
    assert threads_note(_resolve(script, env={"OMP_NUM_THREADS": "3"})) is None


def test_check_port_free_on_held_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(UsageError, match=f"master port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)


def test_check_port_free_on_free_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_port_free("127.0.0.1", port)  # no exception
    check_port_free("127.0.0.1", 0)


def test_check_port_free_on_foreign_address() -> None:
    with pytest.raises(UsageError, match="not an address of this machine"):
        check_port_free("192.0.2.1", 29500)  # TEST-NET-1, never local


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("host:1234", ("host", 1234)),
        ("host", ("host", 29500)),
        ("[::1]:29400", ("::1", 29400)),
        ("[fd00::2]", ("fd00::2", 29500)),
        ("::1", ("::1", 29500)),
        (" node0:0 ", ("node0", 0)),
    ],
)
def test_split_endpoint(endpoint: str, expected: tuple[str, int]) -> None:
    assert split_endpoint(endpoint, 29500) == expected


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("host:abc", "bad port"),
        ("host:-1", "bad port"),
        ("host:70000", "outside 0..65535"),
        (":1234", "no host"),
        ("[]:1234", "no host"),
    ],
)
def test_split_endpoint_errors(endpoint: str, problem: str) -> None:
    with pytest.raises(UsageError, match=problem):
        split_endpoint(endpoint, 29500)


def test_elastic_range_with_master_addr_uses_c10d(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    spec = resolve(LaunchRequest(entry=str(script), nnodes="1:4", master_addr="10.0.0.1"), {}, 0)
    assert spec.rdzv_backend == "c10d" and (spec.min_nodes, spec.max_nodes) == (1, 4)
    with pytest.raises(UsageError, match="c10d"):
        resolve(
            LaunchRequest(
                entry=str(script), nnodes="1:4", master_addr="10.0.0.1", rdzv_backend="static"
            ),
            {},
            0,
        )


def test_unicode_digit_gpu_index_is_rejected() -> None:
    with pytest.raises(UsageError, match="--gpus"):
        parse_gpus("\u00b2", {}, 2)


def test_nodes_of_one_job_share_the_run_id(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    ids = {
        resolve(
            LaunchRequest(entry=str(script), nnodes="2", node_rank=r, master_addr="10.0.0.1"),
            {},
            0,
        ).rdzv_id
        for r in range(2)
    }
    assert len(ids) == 1
