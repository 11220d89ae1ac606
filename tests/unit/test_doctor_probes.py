"""Probes, for real on this machine; NVML parsing through a scripted NVML; the
interface rules of gloo and NCCL."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from manygpu.doctor import gpu, probes
from manygpu.doctor.facts import Facts, InterfaceFacts, TorchFacts
from manygpu.doctor.netpick import nccl_match, pick_gloo, pick_nccl


@pytest.fixture(scope="module")
def facts() -> Facts:
    return probes.gather()


def test_real_probe_of_this_machine(facts: Facts) -> None:
    assert facts.system.hostname == socket.gethostname()
    assert facts.system.python == platform.python_version()
    assert facts.system.kernel == platform.release()
    assert facts.system.cpus >= 1 and (facts.system.memory_bytes or 0) > 0
    assert facts.torch.version == torch.__version__
    assert facts.torch.gloo_available
    assert facts.limits.shm_bytes is not None and facts.limits.shm_bytes > 0
    assert facts.limits.open_files is not None
    names = {i.name for i in facts.network.interfaces}
    assert "lo" in names
    lo = next(i for i in facts.network.interfaces if i.name == "lo")
    assert lo.is_loopback and "127.0.0.1" in lo.addresses
    assert facts.network.gloo_interface in names
    assert Facts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the facts of a machine without GPU")
def test_real_probe_without_gpu(facts: Facts) -> None:
    assert facts.torch.build == "cpu" and facts.torch.cuda is None
    assert not facts.torch.cuda_available and facts.torch.device_count == 0
    assert facts.gpus == [] and facts.links == []
    assert facts.driver.version is None and facts.driver.error  # says why: no driver / NVML


def test_env_facts_come_from_the_given_environment() -> None:
    env = {"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo", "HOME": "/root", "TORCH_X": "1"}
    assert probes.relevant_env(env) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_DEBUG": "INFO",
        "TORCH_X": "1",
    }
    facts = probes.gather(env, full=False)
    assert facts.env == probes.relevant_env(env)
    assert facts.network.gloo_interface == "lo"
    assert facts.network.gloo_reason == "GLOO_SOCKET_IFNAME=lo"


def test_bounded_gives_up_instead_of_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(probes.ProbeTimeout, match=r"within 0\.2s"):
        probes.bounded(lambda: time.sleep(5), 0.2, "sleep")
    assert time.monotonic() - start < 2
    assert probes.bounded(lambda: 42, 1, "answer") == 42
    with pytest.raises(ZeroDivisionError):
        probes.bounded(lambda: 1 / 0, 1, "boom")


def test_a_stuck_gpu_probe_becomes_an_unknown_fact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "GPU_TIMEOUT_S", 0.2)
    monkeypatch.setattr(probes, "probe_gpus", lambda *a, **k: time.sleep(5))
    start = time.monotonic()
    facts = probes.gather({}, full=False)
    assert time.monotonic() - start < 4
    assert facts.gpus == [] and "did not answer within 0.2s" in (facts.driver.error or "")
    assert "is a GPU hung?" in facts.errors["gpus"]


def test_parsers() -> None:
    assert (
        probes.os_name('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n') == "Ubuntu 22.04.4 LTS"
    )
    assert probes.format_cudnn(90100) == "9.1.0"
    assert probes.format_cudnn(8902) == "8.9.2"
    assert gpu.nvml_cuda_version(12040) == "12.4"
    assert gpu.nvml_cuda_version(11080) == "11.8"
    assert gpu.bus_key("00000000:18:00.0") == gpu.bus_key("0000:18:00.0")


def test_rdma_from_sysfs(tmp_path: Path) -> None:
    for dev, state in (("mlx5_0", "4: ACTIVE"), ("mlx5_1", "1: DOWN")):
        port = tmp_path / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
        (tmp_path / dev / "device" / "net" / f"ib{dev[-1]}").mkdir(parents=True)
    ports = probes.probe_rdma(tmp_path)
    assert [(p.device, p.state, p.netdev) for p in ports] == [
        ("mlx5_0", "ACTIVE", "ib0"),
        ("mlx5_1", "DOWN", "ib1"),
    ]
    assert ports[0].rate == "400 Gb/sec (4X NDR)" and ports[0].link_layer == "InfiniBand"
    assert probes.probe_rdma(tmp_path / "missing") == []


# -- NVML, scripted: two NVSwitch-connected GPUs and one on PCIe only ----------------------


class NVMLError(Exception):
    pass


def fake_nvml(fail_init: bool = False) -> types.ModuleType:
    nv: Any = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    consts = {
        "NVML_TEMPERATURE_GPU": 0,
        "NVML_CLOCK_SM": 1,
        "NVML_CLOCK_MEM": 2,
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
        "NVML_VOLATILE_ECC": 0,
        "NVML_NVLINK_MAX_LINKS": 18,
        "NVML_FEATURE_ENABLED": 1,
        "NVML_NVLINK_DEVICE_TYPE_SWITCH": 2,
        "NVML_P2P_CAPS_INDEX_READ": 0,
    }
    for k, v in consts.items():
        setattr(nv, k, v)
    buses = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:CA:00.0"]

    def init() -> None:
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    def nvlink_state(h: int, link: int) -> int:
        if h == 2 or link >= 18:
            raise NVMLError("Not Supported")
        return 1

    def p2p(a: int, b: int, _: int) -> int:
        return 0 if 2 not in (a, b) else 1  # chipset not supported

    def not_supported(*_: Any) -> Any:
        raise NVMLError("Not Supported")

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: None
    nv.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    nv.nvmlSystemGetCudaDriverVersion = lambda: 12040
    nv.nvmlDeviceGetCount = lambda: 3
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3" if h < 2 else "NVIDIA L4"
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"
    nv.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=buses[h])
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=85520809984, used=1 << 29)
    nv.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0) if h < 2 else (8, 9)
    nv.nvmlDeviceGetEccMode = lambda h: (1, 1) if h < 2 else (0, 0)
    nv.nvmlDeviceGetTotalEccErrors = lambda h, *_: 0
    nv.nvmlDeviceGetTemperature = lambda h, _: 30 + h
    nv.nvmlDeviceGetPowerUsage = lambda h: 71944
    nv.nvmlDeviceGetEnforcedPowerLimit = not_supported
    nv.nvmlDeviceGetClockInfo = lambda h, c: 345 if c == 1 else 2619
    nv.nvmlDeviceGetMaxClockInfo = lambda h, c: 1980
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: (
        [
            types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=1 << 30),  # the doctor itself
            types.SimpleNamespace(pid=1, usedGpuMemory=1 << 30),
        ]
        if h == 0
        else []
    )
    nv.nvmlDeviceGetNvLinkState = nvlink_state
    nv.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: 2
    nv.nvmlDeviceGetNvLinkRemotePciInfo = not_supported
    nv.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 50
    nv.nvmlDeviceGetP2PStatus = p2p
    return nv


def cpu_torch() -> TorchFacts:
    return TorchFacts(version="2.5.1+cu124", build="cuda", cuda="12.4", cuda_available=False)


def test_nvml_probe_reads_gpus_and_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    errors: dict[str, str] = {}
    driver, gpus, links = gpu.probe(cpu_torch(), errors)
    assert errors == {}
    assert (driver.version, driver.cuda, driver.error) == ("550.54.15", "12.4", None)
    assert [g.name for g in gpus] == ["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA L4"]
    h0 = gpus[0]
    assert h0.compute_capability == "9.0" and h0.ecc_enabled and h0.ecc_uncorrected_errors == 0
    assert h0.power_w == pytest.approx(71.944) and h0.power_limit_w is None  # not supported
    assert (h0.sm_clock_mhz, h0.sm_clock_max_mhz, h0.mem_clock_mhz) == (345, 1980, 2619)
    assert [p.pid for p in h0.processes] == [1] and h0.processes[0].name  # not ourselves
    assert [g.nvlinks_active for g in gpus] == [18, 18, 0]
    assert gpus[2].ecc_uncorrected_errors is None  # ECC off: not asked
    paths = {(link.a, link.b): (link.path, link.p2p, link.p2p_detail) for link in links}
    assert paths == {
        (0, 1): ("NV18", True, None),
        (0, 2): ("SYS", False, "chipset not supported"),
        (1, 2): ("SYS", False, "chipset not supported"),
    }


def test_nvml_without_driver_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(fail_init=True))
    driver, gpus, links = gpu.probe(cpu_torch(), {})
    assert driver.error == "no NVIDIA driver: NVML Shared Library Not Found"
    assert gpus == [] and links == []


def test_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    driver, gpus, _ = gpu.probe(cpu_torch(), {})
    assert driver.error is not None and "nvidia-ml-py is not installed" in driver.error
    assert gpus == []


# -- which interface gloo and NCCL pick ---------------------------------------------------

ITFS = [
    InterfaceFacts(name="lo", addresses=["127.0.0.1", "::1"], is_up=True, is_loopback=True),
    InterfaceFacts(name="docker0", addresses=["172.17.0.1"], is_up=True),
    InterfaceFacts(name="eth0", addresses=["10.0.0.5"], is_up=True),
    InterfaceFacts(name="eth1", addresses=["192.168.1.5"], is_up=False),
    InterfaceFacts(name="ib0", addresses=["172.16.0.5"], is_up=True),
]


def test_nccl_ifname_syntax() -> None:
    names = [i.name for i in ITFS]
    assert nccl_match("eth", names) == ["eth0", "eth1"]
    assert nccl_match("=eth0", names) == ["eth0"]
    assert nccl_match("=eth", names) == []
    assert nccl_match("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert nccl_match("^=eth0", names) == ["lo", "docker0", "eth1", "ib0"]
    assert nccl_match("eth0,ib", names) == ["eth0", "ib0"]


def test_nccl_pick_order() -> None:
    assert pick_nccl(None, ITFS)[0] == ["ib0"]
    no_ib = [i for i in ITFS if i.name != "ib0"]
    assert pick_nccl(None, no_ib)[0] == ["eth0"]  # not docker0, lo, nor the down eth1
    assert pick_nccl(None, ITFS[:1])[0] == ["lo"]
    assert pick_nccl("eth", ITFS) == (["eth0"], "NCCL_SOCKET_IFNAME=eth")


def test_gloo_pick_follows_the_hostname() -> None:
    assert pick_gloo(None, ["10.0.0.5"], ITFS) == (
        "eth0",
        "10.0.0.5",
        "the hostname resolves to 10.0.0.5",
    )
    assert pick_gloo(None, ["127.0.1.1"], ITFS)[0] == "lo"  # Debian's /etc/hosts default
    name, address, why = pick_gloo(None, ["203.0.113.9"], ITFS)
    assert (name, address) == ("lo", "127.0.0.1") and "loopback fallback" in why
    assert pick_gloo(None, [], ITFS)[2] == "the hostname does not resolve; loopback fallback"
    assert pick_gloo("ib0,eth0", ["10.0.0.5"], ITFS)[:2] == ("ib0", "172.16.0.5")
