"""manygpu: from one GPU to every GPU of a machine, and to many machines.

The Python API is one object, :class:`Parallel`; the CLI is ``manygpu``
(``launch``, ``demo``).
"""

from manygpu.core import Parallel, ParallelConfig
from manygpu.errors import CollectiveTimeoutError, LaunchError, ManyGPUError, UsageError
from manygpu.strategies import (
    DDPOptions,
    FSDPOptions,
    MeshSpec,
    PipelineOptions,
    TensorOptions,
)
from manygpu.strategies import available as available_strategies

__version__ = "0.1.0"

__all__ = [
    "CollectiveTimeoutError",
    "DDPOptions",
    "FSDPOptions",
    "LaunchError",
    "ManyGPUError",
    "MeshSpec",
    "Parallel",
    "ParallelConfig",
    "PipelineOptions",
    "TensorOptions",
    "UsageError",
    "__version__",
    "available_strategies",
]
