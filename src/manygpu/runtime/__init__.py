"""Who this process is in the job, which device it drives, and its process group."""

from manygpu.runtime.cluster import ClusterInfo, detect_cluster
from manygpu.runtime.device import choose_backend, choose_device
from manygpu.runtime.process_group import DistContext, init_distributed

__all__ = [
    "ClusterInfo",
    "DistContext",
    "choose_backend",
    "choose_device",
    "detect_cluster",
    "init_distributed",
]
