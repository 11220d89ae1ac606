"""A cluster as the planner sees it: devices, their memory and speed, and two kinds of link.

Compute comes from the devices' table (:mod:`.devices`: what training reaches
per precision, not the data-sheet peak). The links' numbers are the ones an
alpha-beta model needs: per link a latency (alpha,
per ring step) and a bandwidth (1/beta). Within a node a ring runs over
NVLink / PCIe; across nodes every ring step waits for the slowest hop, the
network, and each node's NIC carries one ring edge in each direction.

Latencies default to NCCL's own cost model for the ring algorithm with the
"simple" protocol (``src/graph/tuning.cc``, ``hwLat``): NVLink 3.4 us,
PCIe 5.7 us, network 14 us per step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from manygpu.errors import UsageError
from manygpu.plan.devices import DEVICES, Device, Kind

DEFAULT_MFU = 0.4
"""The fraction of a bare ``peak_tflops`` assumed reached (a cluster without a known device)."""

NCCL_RING_LATENCY_US = {"nvlink": 3.4, "pcie": 5.7, "net": 14.0}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Devices and links; every bandwidth is GB/s (1e9 bytes) in one direction."""

    name: str
    nodes: int = 1
    gpus_per_node: int
    """Devices (GPUs, or CPU processes) per node."""
    memory_gb: float
    """Memory per device, GB (1e9 bytes)."""
    device: Device | None = None
    """The device's speeds per precision; ``None``: only ``peak_tflops`` is known."""
    peak_tflops: float = 0.0
    """Without a ``device``: the dense peak at the training precision (``DEFAULT_MFU``
    of it is assumed reached unless an MFU is given)."""
    intra_bw_gbs: float
    """What a ring all-reduce achieves per device inside a node (nccl-tests' busbw)."""
    intra_latency_us: float
    inter_bw_gbs: float
    """Network bandwidth per node (all its NICs together)."""
    inter_latency_us: float
    overlap: bool = True
    """Whether communication runs beside compute. True for GPUs (NCCL has its
    own SMs / copy engines); False for CPU processes, where gloo's threads
    need the same cores as the model."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise UsageError(f"cluster {name} must be >= 1, got {getattr(self, name)}")
        for name in ("memory_gb", "intra_bw_gbs", "inter_bw_gbs"):
            if not getattr(self, name) > 0:
                raise UsageError(f"cluster {name} must be > 0, got {getattr(self, name)}")
        if self.device is None and not self.peak_tflops > 0:
            raise UsageError(
                f"cluster peak_tflops must be > 0 without a known device, got {self.peak_tflops}"
            )
        for name in ("intra_latency_us", "inter_latency_us"):
            if getattr(self, name) < 0:
                raise UsageError(f"cluster {name} must be >= 0, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def tflops(self, precision: str, kind: Kind, mfu: float | None = None) -> float:
        """TFLOP/s one device reaches in training: the device's achievable rate for
        ``kind`` at ``precision``, or ``mfu`` x its peak when an MFU is given."""
        if self.device is None:
            return self.peak_tflops * (DEFAULT_MFU if mfu is None else mfu)
        if mfu is not None:
            self.device.check(precision)
            return self.device.peak_tflops[precision] * mfu
        return self.device.achievable_tflops(precision, kind)

    def ring_link(self, ranks: int) -> tuple[float, float]:
        """(bandwidth GB/s, latency us) of a ring over the first ``ranks`` devices."""
        if ranks > self.gpus_per_node:
            return min(self.inter_bw_gbs, self.intra_bw_gbs), self.inter_latency_us
        return self.intra_bw_gbs, self.intra_latency_us

    def with_size(self, *, nodes: int | None = None, gpus_per_node: int | None = None) -> Cluster:
        return replace(
            self,
            nodes=self.nodes if nodes is None else nodes,
            gpus_per_node=self.gpus_per_node if gpus_per_node is None else gpus_per_node,
        )


def _gbit(gbit_per_s: float) -> float:
    return gbit_per_s / 8


PRESETS: dict[str, Cluster] = {
    # Horovod paper (arXiv:1802.05799): 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE.
    # P100 PCIe: 16 GB, 9.3 TFLOP/s fp32; GPUs in a server share PCIe 3.0 x16 (~10 GB/s).
    "p100-roce25": Cluster(
        name="4x P100 (PCIe) per node, 25 Gbit/s RoCE",
        gpus_per_node=4,
        memory_gb=16,
        device=DEVICES["p100"],
        intra_bw_gbs=10.0,
        intra_latency_us=NCCL_RING_LATENCY_US["pcie"],
        inter_bw_gbs=_gbit(25),
        inter_latency_us=NCCL_RING_LATENCY_US["net"],
    ),
    # DGX-1V: 8 V100 16 GB in an NVLink hybrid cube-mesh; NCCL all-reduce busbw
    # ~ 130 GB/s; 4 x 100 Gbit/s InfiniBand per node.
    "v100": Cluster(
        name="8x V100 (NVLink) per node, 4x 100 Gbit/s InfiniBand",
        gpus_per_node=8,
        memory_gb=16,
        device=DEVICES["v100"],
        intra_bw_gbs=130.0,
        intra_latency_us=NCCL_RING_LATENCY_US["nvlink"],
        inter_bw_gbs=_gbit(400),
        inter_latency_us=NCCL_RING_LATENCY_US["net"],
    ),
    # 4 T4 16 GB on PCIe 3.0 behind one host (~10 GB/s ring), 50 Gbit/s Ethernet between hosts
    # (the AWS g4dn.12xlarge instance type's published network bandwidth).
    "t4": Cluster(
        name="4x T4 (PCIe) per node, 50 Gbit/s Ethernet",
        gpus_per_node=4,
        memory_gb=16,
        device=DEVICES["t4"],
        intra_bw_gbs=10.0,
        intra_latency_us=NCCL_RING_LATENCY_US["pcie"],
        inter_bw_gbs=_gbit(50),
        inter_latency_us=NCCL_RING_LATENCY_US["net"],
    ),
    # DGX A100: 8 A100 80 GB on NVSwitch (~230 GB/s busbw), 8 x 200 Gbit/s HDR per node.
    "a100": Cluster(
        name="8x A100 80GB (NVSwitch) per node, 8x 200 Gbit/s InfiniBand",
        gpus_per_node=8,
        memory_gb=80,
        device=DEVICES["a100"],
        intra_bw_gbs=230.0,
        intra_latency_us=NCCL_RING_LATENCY_US["nvlink"],
        inter_bw_gbs=_gbit(1600),
        inter_latency_us=NCCL_RING_LATENCY_US["net"],
    ),
    # DGX H100: 8 H100 SXM 80 GB on NVLink 4 (~ 450 GB/s busbw), 8 x 400 Gbit/s NDR.
    "h100": Cluster(
        name="8x H100 SXM 80GB (NVLink) per node, 8x 400 Gbit/s InfiniBand",
        gpus_per_node=8,
        memory_gb=80,
        device=DEVICES["h100"],
        intra_bw_gbs=450.0,
        intra_latency_us=NCCL_RING_LATENCY_US["nvlink"],
        inter_bw_gbs=_gbit(3200),
        inter_latency_us=NCCL_RING_LATENCY_US["net"],
    ),
}


def preset(name: str, *, nodes: int = 1, gpus_per_node: int | None = None) -> Cluster:
    """A named preset resized to ``nodes`` (and optionally devices per node)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise UsageError(
            f"unknown cluster {name!r}; choose one of {', '.join(PRESETS)} or 'this'"
        ) from None
    return base.with_size(nodes=nodes, gpus_per_node=gpus_per_node)
