"""GPU probes: NVML (through nvidia-ml-py) for the driver, every GPU and the
topology; torch for what CUDA itself will do (peer access), and as the only
source on ROCm or where NVML is missing.

nvidia-ml-py is imported lazily: without it, or without a driver
(``NVMLError``), the driver facts carry the reason and the GPU list comes from
torch (empty on a machine without GPUs).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from manygpu.doctor.facts import DriverFacts, GPUFacts, GPULink, GPUProcess, TorchFacts

# nvmlDeviceGetTopologyCommonAncestor levels -> nvidia-smi topo -m labels.
TOPOLOGY_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
P2P_STATUS = {
    1: "chipset not supported",
    2: "GPU not supported",
    3: "IOH topology not supported",
    4: "disabled by registry key",
    5: "not supported",
    6: "unknown",
}

Probed = tuple[DriverFacts, list[GPUFacts], list[GPULink]]


def probe(torch_facts: TorchFacts, errors: dict[str, str], *, full: bool = True) -> Probed:
    """Driver, GPUs and links; NVML first, torch where NVML cannot answer."""
    driver = DriverFacts()
    gpus: list[GPUFacts] = []
    links: list[GPULink] = []
    try:
        import pynvml
    except ImportError:
        driver.error = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    else:
        try:
            driver, gpus, links = _probe_nvml(pynvml, full)
        except pynvml.NVMLError as exc:
            driver.error = f"no NVIDIA driver: {exc}"
        except Exception as exc:
            driver.error = f"NVML probe failed: {exc}"
            errors["nvml"] = str(exc)
    if torch_facts.cuda_available:
        try:
            gpus, links = _merge_torch(gpus, links, full)
        except Exception as exc:
            errors["torch_gpus"] = str(exc)
    return driver, gpus, links


def nvml_cuda_version(number: int) -> str:
    """``12040`` -> ``12.4`` (NVML's ``nvmlSystemGetCudaDriverVersion``)."""
    return f"{number // 1000}.{number % 1000 // 10}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _probe_nvml(nv: Any, full: bool) -> Probed:
    nv.nvmlInit()
    try:
        driver = DriverFacts(
            version=_text(nv.nvmlSystemGetDriverVersion()),
            cuda=nvml_cuda_version(nv.nvmlSystemGetCudaDriverVersion()),
        )
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        gpus = [_gpu(nv, i, h, full) for i, h in enumerate(handles)]
        links = _links(nv, handles, gpus) if full else []
        return driver, gpus, links
    finally:
        nv.nvmlShutdown()


def _ask(nv: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """One NVML query; ``None`` when this GPU or driver does not support it."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


def _gpu(nv: Any, index: int, h: Any, full: bool) -> GPUFacts:
    mem = _ask(nv, nv.nvmlDeviceGetMemoryInfo, h)
    cc = _ask(nv, nv.nvmlDeviceGetCudaComputeCapability, h)
    ecc = _ask(nv, nv.nvmlDeviceGetEccMode, h)
    power = _ask(nv, nv.nvmlDeviceGetPowerUsage, h)
    limit = _ask(nv, nv.nvmlDeviceGetEnforcedPowerLimit, h)
    pci = _ask(nv, nv.nvmlDeviceGetPciInfo, h)
    facts = GPUFacts(
        index=index,
        name=_text(nv.nvmlDeviceGetName(h)),
        uuid=_text(_ask(nv, nv.nvmlDeviceGetUUID, h) or ""),
        pci_bus_id=_text(pci.busId) if pci is not None else "",
        memory_total_bytes=int(mem.total) if mem is not None else None,
        memory_used_bytes=int(mem.used) if mem is not None else None,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        ecc_enabled=bool(ecc[0]) if ecc is not None else None,
        temperature_c=_ask(nv, nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
        power_w=power / 1000 if power is not None else None,
        power_limit_w=limit / 1000 if limit is not None else None,
        sm_clock_mhz=_ask(nv, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
        sm_clock_max_mhz=_ask(nv, nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
        mem_clock_mhz=_ask(nv, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
    )
    if facts.ecc_enabled:
        facts.ecc_uncorrected_errors = _ask(
            nv,
            nv.nvmlDeviceGetTotalEccErrors,
            h,
            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nv.NVML_VOLATILE_ECC,
        )
    if full:
        facts.processes = _processes(nv, h)
    return facts


def _ours() -> set[int]:
    """This process, its launcher, and the launcher's other workers (the doctor's
    own ranks hold GPUs too; they are not someone else's job)."""
    import psutil

    ours = {os.getpid(), os.getppid()}
    with contextlib.suppress(psutil.Error, OSError):
        ours |= {c.pid for c in psutil.Process(os.getppid()).children()}
    return ours


def _processes(nv: Any, h: Any) -> list[GPUProcess]:
    import psutil

    out = []
    ours = _ours()
    for p in _ask(nv, nv.nvmlDeviceGetComputeRunningProcesses, h) or []:
        if p.pid in ours:
            continue
        try:
            name = psutil.Process(p.pid).name()
        except (psutil.Error, OSError):
            name = ""  # another container's pid, or gone already
        used = p.usedGpuMemory
        out.append(GPUProcess(pid=int(p.pid), name=name, used_memory_bytes=used))
    return out


def bus_key(bus_id: str) -> tuple[int, int, str]:
    """``00000000:18:00.0`` and ``0000:18:00.0`` name the same device."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) != 3:
        return (0, 0, bus_id.strip().lower())
    return (int(parts[0], 16), int(parts[1], 16), parts[2])


def _nvlinks(nv: Any, handles: list[Any], gpus: list[GPUFacts]) -> list[dict[int | str, int]]:
    """Per GPU: active links to each peer GPU index, and to ``"switch"`` (NVSwitch)."""
    by_bus = {bus_key(g.pci_bus_id): g.index for g in gpus if g.pci_bus_id}
    counts: list[dict[int | str, int]] = []
    for g, h in zip(gpus, handles, strict=True):
        mine: dict[int | str, int] = {}
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                state = nv.nvmlDeviceGetNvLinkState(h, link)
            except nv.NVMLError:
                break  # a PCIe GPU, or past its last link
            if state != nv.NVML_FEATURE_ENABLED:
                continue
            kind = _ask(nv, nv.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            if kind == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                mine["switch"] = mine.get("switch", 0) + 1
                continue
            remote = _ask(nv, nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
            peer = by_bus.get(bus_key(_text(remote.busId))) if remote is not None else None
            if peer is not None:
                mine[peer] = mine.get(peer, 0) + 1
        g.nvlinks_active = sum(mine.values())
        counts.append(mine)
    return counts


def _links(nv: Any, handles: list[Any], gpus: list[GPUFacts]) -> list[GPULink]:
    nvl = _nvlinks(nv, handles, gpus)
    out = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            direct = nvl[a].get(b, 0)
            switched = min(nvl[a].get("switch", 0), nvl[b].get("switch", 0))
            n = direct or switched
            if n:
                path = f"NV{n}"
            else:
                level = _ask(nv, nv.nvmlDeviceGetTopologyCommonAncestor, handles[a], handles[b])
                path = TOPOLOGY_LABELS.get(level, "?") if level is not None else "?"
            status = _ask(
                nv, nv.nvmlDeviceGetP2PStatus, handles[a], handles[b], nv.NVML_P2P_CAPS_INDEX_READ
            )
            out.append(
                GPULink(
                    a=a,
                    b=b,
                    path=path,
                    p2p=None if status is None else status == 0,
                    p2p_detail=P2P_STATUS.get(status) if status else None,
                )
            )
    return out


def _uuid_key(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-")


def _merge_torch(
    gpus: list[GPUFacts], links: list[GPULink], full: bool
) -> tuple[list[GPUFacts], list[GPULink]]:
    """Fill in what torch sees; torch's peer access (what CUDA will do) wins over NVML's."""
    import torch

    count = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    if not gpus:  # ROCm, or no NVML: torch is the only source
        gpus = [
            GPUFacts(
                index=i,
                name=p.name,
                uuid=str(getattr(p, "uuid", "")),
                memory_total_bytes=int(p.total_memory),
                compute_capability=f"{p.major}.{p.minor}",
            )
            for i, p in enumerate(props)
        ]
    # torch index -> NVML index (they differ under CUDA_VISIBLE_DEVICES).
    nvml_of = {_uuid_key(g.uuid): g.index for g in gpus if g.uuid}
    index = [nvml_of.get(_uuid_key(str(getattr(p, "uuid", ""))), i) for i, p in enumerate(props)]
    if not full:
        return gpus, links
    by_pair = {(link.a, link.b): link for link in links}
    for i in range(count):
        for j in range(i + 1, count):
            a, b = sorted((index[i], index[j]))
            link = by_pair.setdefault((a, b), GPULink(a=a, b=b))
            can = torch.cuda.can_device_access_peer(i, j) and torch.cuda.can_device_access_peer(
                j, i
            )
            link.p2p = bool(can)
            if can:
                link.p2p_detail = None
    return gpus, sorted(by_pair.values(), key=lambda link: (link.a, link.b))
