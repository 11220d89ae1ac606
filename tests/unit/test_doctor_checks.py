"""Every doctor check on recorded fact sets: the ok, warn and fail cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from manygpu.doctor import checks, hostchecks
from manygpu.doctor.checks import run_checks, supports_arch
from manygpu.doctor.facts import UNLIMITED, Facts, GPUProcess, InterfaceFacts, RDMAPort
from manygpu.doctor.result import CheckResult, human_bytes, worst

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"


def load(name: str) -> Facts:
    return Facts.from_dict(json.loads((FIXTURES / f"{name}.json").read_text()))


@pytest.fixture
def h100() -> Facts:
    """8x H100 SXM, NVSwitch, 8 NDR InfiniBand ports: everything right."""
    return load("h100_sxm_8x")


@pytest.fixture
def a100() -> Facts:
    """4x A100 PCIe in a container: 64 MB /dev/shm, no P2P across sockets, bad IFNAME."""
    return load("a100_pcie_4x")


@pytest.fixture
def old() -> Facts:
    """2x V100 on driver 470 (CUDA 11.4) with a torch built for CUDA 12.1."""
    return load("old_driver_v100_2x")


def by_name(results: list[CheckResult], name: str) -> list[CheckResult]:
    return [r for r in results if r.name == name]


def one(results: list[CheckResult]) -> CheckResult:
    assert len(results) == 1, results
    return results[0]


@pytest.mark.parametrize("name", ["h100_sxm_8x", "a100_pcie_4x", "old_driver_v100_2x"])
def test_fixtures_round_trip_through_json(name: str) -> None:
    facts = load(name)
    assert Facts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


def test_healthy_h100_box_passes_every_check(h100: Facts) -> None:
    results = run_checks(h100)
    assert worst(results) == "ok", [r for r in results if r.status != "ok"]
    names = {r.name for r in results}
    assert {"gpus", "driver", "arch", "libraries", "p2p", "shm", "interface", "rdma"} <= names
    assert "NV18 x28" in one(by_name(results, "p2p")).message
    assert "8 RDMA port(s) ACTIVE (400 Gb/sec (4X NDR))" in one(by_name(results, "rdma")).message


def test_a100_container_findings(a100: Facts) -> None:
    results = run_checks(a100)
    assert worst(results) == "fail"
    shm = one(by_name(results, "shm"))
    assert shm.status == "fail"
    assert shm.message == "/dev/shm is 64 MB: NCCL and DataLoader workers need more"
    assert "--shm-size=8g or --ipc=host" in shm.fix
    p2p = one(by_name(results, "p2p"))
    assert p2p.status == "warn"
    assert p2p.message.startswith("GPU 0 and 2, 0 and 3, 1 and 2, 1 and 3 have no P2P access")
    assert "traffic goes through the host" in p2p.message
    ifname = one(by_name(results, "ifname"))
    assert ifname.status == "fail"
    assert "NCCL_SOCKET_IFNAME=eth1 names an interface that does not exist" in ifname.message
    assert "eth0" in ifname.fix
    busy = one(by_name(results, "gpu_busy"))
    assert busy.status == "warn" and "GPU 1 is in use by pid 48213 python3 (32 GB)" in busy.message


def test_old_driver_fails_with_versions_named(old: Facts) -> None:
    results = run_checks(old)
    driver = one(by_name(results, "driver"))
    assert driver.status == "fail"
    assert "supports CUDA 11.4 but PyTorch was built for 12.1" in driver.message
    assert "R530" in driver.fix
    gpus = one(by_name(results, "gpus"))
    assert gpus.status == "fail"
    assert gpus.message.endswith("driver on your system is too old (found version 11040)")
    assert one(by_name(results, "open_files")).status == "warn"


def test_older_minor_driver_is_a_warning(h100: Facts) -> None:
    h100.driver.cuda, h100.torch.cuda = "12.2", "12.8"
    result = one(checks.check_driver(h100))
    assert result.status == "warn"
    assert "driver 550.54.15 supports CUDA 12.2 but PyTorch was built for 12.8" in result.message
    assert "R570" in result.fix


def test_driver_check_skips_without_cuda(h100: Facts) -> None:
    h100.torch.build, h100.torch.cuda = "cpu", None
    assert checks.check_driver(h100) == []


def test_no_gpu_is_said_plainly(h100: Facts) -> None:
    h100.gpus, h100.links = [], []
    h100.torch.cuda_available = False
    h100.driver.error = "no NVIDIA driver: NVML Shared Library Not Found"
    result = one(checks.check_gpus(h100))
    assert result.status == "warn"
    assert result.message.startswith("no GPU on this machine")
    assert "gloo" in result.message
    assert checks.check_p2p(h100) == [] and checks.check_gpu_health(h100) == []


def test_cpu_torch_on_gpu_machine_fails(h100: Facts) -> None:
    h100.torch.build, h100.torch.version, h100.torch.cuda_available = "cpu", "2.5.1+cpu", False
    result = one(checks.check_gpus(h100))
    assert result.status == "fail" and "CPU build but this machine has 8 GPU(s)" in result.message


def test_empty_visible_devices_hides_gpus(h100: Facts) -> None:
    h100.torch.cuda_available, h100.torch.device_count = False, 0
    h100.env["CUDA_VISIBLE_DEVICES"] = ""
    result = one(checks.check_gpus(h100))
    assert result.status == "fail" and "hides all 8 GPUs" in result.message


@pytest.mark.parametrize(
    ("cc", "arch", "expected"),
    [
        ("9.0", ["sm_80", "sm_90"], True),
        ("8.6", ["sm_80"], True),  # same major, lower minor: binary compatible
        ("7.0", ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"], False),
        ("12.0", ["sm_90", "sm_100", "sm_120"], True),
        ("10.0", ["sm_90", "compute_90"], True),  # PTX JIT
        ("8.0", ["sm_86"], False),
    ],
)
def test_supports_arch(cc: str, arch: list[str], expected: bool) -> None:
    assert supports_arch(cc, arch) is expected


def test_arch_missing_fails(old: Facts) -> None:
    old.torch.arch_list = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    results = checks.check_arch(old)
    assert [r.status for r in results] == ["fail", "fail"]
    assert "GPU 0 (Tesla V100-SXM2-32GB, sm_70) is not among" in results[0].message


def test_missing_nccl_and_cudnn(h100: Facts) -> None:
    h100.torch.nccl_available, h100.torch.nccl, h100.torch.cudnn = False, None, None
    results = checks.check_libraries(h100)
    assert {(r.name, r.status) for r in results} == {("nccl", "fail"), ("cudnn", "warn")}


def test_mixed_models_warn(a100: Facts) -> None:
    assert checks.check_gpu_models(a100) == []
    a100.gpus[3].name = "NVIDIA A40"
    result = one(checks.check_gpu_models(a100))
    assert result.status == "warn" and "3 x NVIDIA A100 80GB PCIe, 1 x NVIDIA A40" in result.message


def test_gpu_health_ecc_and_heat(h100: Facts) -> None:
    h100.gpus[5].ecc_uncorrected_errors = 3
    h100.gpus[2].temperature_c = 91
    h100.gpus[0].processes = [GPUProcess(pid=7, name="python", used_memory_bytes=None)]
    results = checks.check_gpu_health(h100)
    assert {(r.name, r.status) for r in results} == {
        ("gpu_health", "fail"),
        ("gpu_health", "warn"),
        ("gpu_busy", "warn"),
    }
    assert any("GPU 5 has 3 uncorrected ECC errors" in r.message for r in results)


@pytest.mark.parametrize(
    ("size", "status"), [(64 << 20, "fail"), (1 << 30, "warn"), (8 << 30, "ok"), (None, "fail")]
)
def test_shm_thresholds(a100: Facts, size: int | None, status: str) -> None:
    a100.limits.shm_bytes = size
    assert one(hostchecks.check_shm(a100)).status == status


def test_memlock_matters_only_with_rdma(h100: Facts, a100: Facts) -> None:
    h100.limits.memlock_bytes = 65536
    memlock = one(by_name(hostchecks.check_limits(h100), "memlock"))
    assert memlock.status == "fail" and "ulimit -l unlimited" in memlock.fix
    assert not by_name(hostchecks.check_limits(a100), "memlock")  # 64 KB but no RDMA
    h100.limits.memlock_bytes = UNLIMITED
    assert one(hostchecks.check_limits(h100)).status == "ok"


def test_gloo_ifname_down_or_missing(old: Facts) -> None:
    old.env["GLOO_SOCKET_IFNAME"] = "eno2"
    result = one(hostchecks.check_ifnames(old))
    assert result.status == "fail" and "which is down" in result.message
    old.env["GLOO_SOCKET_IFNAME"] = "eth9"
    result = one(hostchecks.check_ifnames(old))
    assert "GLOO_SOCKET_IFNAME=eth9 names an interface that does not exist" in result.message
    old.env["GLOO_SOCKET_IFNAME"] = "eno1"
    assert hostchecks.check_ifnames(old) == []


def test_loopback_interface_warns_with_a_suggestion(old: Facts) -> None:
    old.network.gloo_interface, old.network.gloo_address = "lo", "127.0.1.1"
    old.network.gloo_reason = "the hostname resolves to 127.0.1.1"
    result = one(hostchecks.check_network(old))
    assert result.status == "warn" and "unreachable from other nodes" in result.message
    assert "GLOO_SOCKET_IFNAME=eno1" in result.fix


def test_unresolvable_hostname_fails(old: Facts) -> None:
    old.network.hostname_error = "v100-old: [Errno -2] Name or service not known"
    results = hostchecks.check_network(old)
    assert one(by_name(results, "hostname")).status == "fail"


def test_nccl_on_loopback_only_warns(h100: Facts) -> None:
    h100.network.nccl_interfaces = ["lo"]
    result = one(hostchecks.check_network(h100))
    assert result.status == "warn" and "NCCL would use only lo" in result.message


def test_rdma_ports_down(h100: Facts) -> None:
    h100.network.rdma[3].state = "DOWN"
    result = one(hostchecks.check_rdma(h100))
    assert result.status == "warn" and "mlx5_3/1 DOWN" in result.message
    for port in h100.network.rdma:
        port.state = "INIT"
    assert one(hostchecks.check_rdma(h100)).message.startswith("8 RDMA port(s), none ACTIVE")
    h100.network.rdma = [RDMAPort(device="mlx5_0", state="ACTIVE", rate="200 Gb/sec (4X HDR)")]
    assert one(hostchecks.check_rdma(h100)).status == "ok"


def test_risky_environment(h100: Facts) -> None:
    h100.env |= {
        "NCCL_P2P_DISABLE": "1",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "NCCL_IB_DISABLE": "0",
    }
    results = hostchecks.check_env(h100)
    assert [r.status for r in results] == ["warn", "warn"]
    assert results[0].message.startswith("NCCL_P2P_DISABLE=1 turns off GPU peer-to-peer")


def test_probe_errors_become_warnings(h100: Facts) -> None:
    h100.errors = {"shm": "/dev/shm: No such file or directory"}
    result = one(checks.check_probes(h100))
    assert result.status == "warn" and "could not probe shm" in result.message


def test_p2p_unknown_pairs_are_counted(a100: Facts) -> None:
    for link in a100.links:
        link.p2p = None if link.p2p is False else link.p2p
    result = one(checks.check_p2p(a100))
    assert result.status == "ok" and "4 pair(s) unknown" in result.message


def test_run_checks_tags_the_host(a100: Facts) -> None:
    assert {r.host for r in run_checks(a100, "node-b")} == {"node-b"}


def test_helpers() -> None:
    assert human_bytes(64 << 20) == "64 MB"
    assert human_bytes(1.5 * (1 << 30)) == "1.5 GB"
    assert human_bytes(1007.8 * (1 << 30)) == "1008 GB"
    assert worst([]) == "ok"
    assert worst([CheckResult("a", "warn", ""), CheckResult("b", "ok", "")]) == "warn"
    itf = InterfaceFacts(name="eth0", addresses=["10.0.0.1"], is_up=True)
    assert itf.is_loopback is False
