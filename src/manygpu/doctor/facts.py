"""What the doctor knows about a machine, as plain data that round-trips through JSON.

Probes fill these in from the real sources; recorded fact sets (tests, bug
reports, ``manygpu doctor --json``) load back into the same types, so checks
run the same way on a live machine and on a file. ``None`` means "unknown":
the probe could not tell, and ``Facts.errors`` says why.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

SCHEMA = 1
"""Version of the JSON layout; bumped when a field changes meaning."""

UNLIMITED = -1
"""A resource limit of ``RLIM_INFINITY`` (``ulimit -l unlimited``)."""


@dataclass
class SystemFacts:
    """The host and its interpreter."""

    hostname: str
    """``socket.gethostname()``."""
    os: str = ""
    """``PRETTY_NAME`` of /etc/os-release, e.g. ``Ubuntu 22.04.4 LTS``."""
    kernel: str = ""
    """``uname -r``."""
    python: str = ""
    """``3.11.9``."""
    cpus: int = 0
    """CPUs this process may run on."""
    memory_bytes: int | None = None
    """Physical memory."""


@dataclass
class TorchFacts:
    """PyTorch's version and build, and what it can use here."""

    version: str
    """``torch.__version__``, e.g. ``2.5.1+cu124``."""
    build: str = "cpu"
    """``cuda``, ``rocm`` or ``cpu``: what the wheel was built for."""
    cuda: str | None = None
    """CUDA version the wheel was built with (``torch.version.cuda``)."""
    hip: str | None = None
    """ROCm/HIP version of a ROCm build."""
    cudnn: str | None = None
    """cuDNN version bundled with torch, e.g. ``9.1.0``."""
    nccl: str | None = None
    """NCCL (or RCCL) version bundled with torch, e.g. ``2.21.5``."""
    arch_list: list[str] = field(default_factory=list)
    """GPU architectures compiled in (``sm_90``, ``compute_90``...)."""
    cuda_available: bool = False
    """``torch.cuda.is_available()``."""
    device_count: int = 0
    """GPUs torch can see (after ``CUDA_VISIBLE_DEVICES``)."""
    cuda_error: str | None = None
    """Why CUDA is unavailable, when torch said (e.g. the driver is too old)."""
    nccl_available: bool = False
    """``torch.distributed.is_nccl_available()``."""
    gloo_available: bool = False
    """``torch.distributed.is_gloo_available()``."""


@dataclass
class DriverFacts:
    """The NVIDIA driver, as NVML reports it."""

    version: str | None = None
    """Driver version, e.g. ``550.54.15``."""
    cuda: str | None = None
    """Newest CUDA version the driver supports, e.g. ``12.4``."""
    error: str | None = None
    """Why NVML could not be asked (no driver, no nvidia-ml-py...)."""


@dataclass
class GPUProcess:
    """A process holding memory on a GPU."""

    pid: int
    name: str = ""
    used_memory_bytes: int | None = None


@dataclass
class GPUFacts:
    """One GPU, indexed as NVML (and ``nvidia-smi``) numbers them."""

    index: int
    name: str
    """``NVIDIA H100 80GB HBM3``."""
    uuid: str = ""
    pci_bus_id: str = ""
    """``00000000:18:00.0``."""
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    compute_capability: str | None = None
    """``9.0``."""
    ecc_enabled: bool | None = None
    ecc_uncorrected_errors: int | None = None
    """Volatile (since boot) uncorrected ECC errors."""
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_mhz: int | None = None
    nvlinks_active: int | None = None
    """Active NVLink links (0 on PCIe-only GPUs)."""
    processes: list[GPUProcess] = field(default_factory=list)
    """Compute processes using it right now."""


@dataclass
class GPULink:
    """How two GPUs reach each other."""

    a: int
    b: int
    path: str = "?"
    """``nvidia-smi topo -m`` label: ``NV18`` (18 NVLinks), ``PIX``, ``PXB``,
    ``PHB``, ``NODE``, ``SYS``, or ``?``."""
    p2p: bool | None = None
    """Whether each can read the other's memory directly."""
    p2p_detail: str | None = None
    """Why not, when the driver said (``chipset not supported``...)."""


@dataclass
class InterfaceFacts:
    """A network interface."""

    name: str
    addresses: list[str] = field(default_factory=list)
    is_up: bool = False
    is_loopback: bool = False
    speed_mbps: int | None = None
    mtu: int | None = None


@dataclass
class RDMAPort:
    """A port of an InfiniBand / RoCE device (/sys/class/infiniband)."""

    device: str
    """``mlx5_0``."""
    port: int = 1
    state: str = ""
    """``ACTIVE``, ``DOWN``, ``INIT``..."""
    rate: str = ""
    """``400 Gb/sec (4X NDR)``."""
    link_layer: str = ""
    """``InfiniBand`` or ``Ethernet`` (RoCE)."""
    netdev: str | None = None
    """The network interface on the same device (``ib0``)."""


@dataclass
class NetworkFacts:
    """Interfaces, name resolution, and the interfaces gloo and NCCL would pick."""

    interfaces: list[InterfaceFacts] = field(default_factory=list)
    hostname_addresses: list[str] = field(default_factory=list)
    """What this host's name resolves to."""
    hostname_error: str | None = None
    gloo_interface: str | None = None
    gloo_address: str | None = None
    gloo_reason: str = ""
    nccl_interfaces: list[str] = field(default_factory=list)
    nccl_reason: str = ""
    rdma: list[RDMAPort] = field(default_factory=list)


@dataclass
class LimitsFacts:
    """Shared memory and per-process limits (``UNLIMITED`` = -1)."""

    shm_bytes: int | None = None
    """Size of /dev/shm."""
    shm_free_bytes: int | None = None
    open_files: int | None = None
    """Soft ``ulimit -n``."""
    open_files_hard: int | None = None
    memlock_bytes: int | None = None
    """Soft ``ulimit -l``, in bytes."""


@dataclass
class Facts:
    """Everything the probes found on one machine."""

    system: SystemFacts
    torch: TorchFacts
    driver: DriverFacts = field(default_factory=DriverFacts)
    gpus: list[GPUFacts] = field(default_factory=list)
    links: list[GPULink] = field(default_factory=list)
    network: NetworkFacts = field(default_factory=NetworkFacts)
    limits: LimitsFacts = field(default_factory=LimitsFacts)
    env: dict[str, str] = field(default_factory=dict)
    """CUDA_VISIBLE_DEVICES, NCCL_*, GLOO_*, TORCH_* and friends."""
    errors: dict[str, str] = field(default_factory=dict)
    """Probe name -> why it failed (its facts are then unknown)."""
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Facts:
        return from_dict(cls, data)


@dataclass
class PairResult:
    """A timed point-to-point exchange between two ranks."""

    a: int
    b: int
    seconds: float | None = None
    """Time of the exchange (both directions at once); ``None`` when it failed."""
    gbps: float | None = None
    """GB/s in each direction."""
    error: str | None = None


@dataclass
class LiveResults:
    """What the short live test across the job's ranks measured."""

    backend: str
    world_size: int
    hosts: list[str] = field(default_factory=list)
    """Host of each rank, in rank order."""
    nbytes: int = 0
    """Bytes sent each way in every pair."""
    all_reduce_ms: float | None = None
    all_reduce_error: str | None = None
    pairs: list[PairResult] = field(default_factory=list)


T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build dataclass ``cls`` (and its nested dataclasses) from ``asdict`` output.

    Unknown keys are ignored, so newer files load into older code.
    """
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {k: _convert(hints[k], v) for k, v in data.items() if k in known}
    return cls(**kwargs)


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner[0], value) if len(inner) == 1 else value
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_convert(item, v) for v in value]
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return from_dict(hint, value)
    return value
