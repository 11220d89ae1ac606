"""Who this process is in the job, which device it drives, and its process group.

Imported on use (PEP 562): ``device`` and ``process_group`` import torch, and
the launcher's driver (``manygpu launch -H``), which only reads the environment
and starts ssh, must not pay ~2.5 s of CPU for it on every launch.
"""

from typing import TYPE_CHECKING

from manygpu import _lazy

if TYPE_CHECKING:
    from manygpu.runtime.cluster import ClusterInfo, detect_cluster
    from manygpu.runtime.device import choose_backend, choose_device
    from manygpu.runtime.process_group import DistContext, init_distributed

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "ClusterInfo": "manygpu.runtime.cluster",
        "detect_cluster": "manygpu.runtime.cluster",
        "choose_backend": "manygpu.runtime.device",
        "choose_device": "manygpu.runtime.device",
        "DistContext": "manygpu.runtime.process_group",
        "init_distributed": "manygpu.runtime.process_group",
    },
)

__all__ = [
    "ClusterInfo",
    "DistContext",
    "choose_backend",
    "choose_device",
    "detect_cluster",
    "init_distributed",
]
