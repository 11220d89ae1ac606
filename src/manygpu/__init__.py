"""manygpu: from one GPU to every GPU of a machine, and to many machines.

The Python API is one object, :class:`Parallel`; the CLI is ``manygpu``
(``launch``, ``demo``). Names are imported on first use, so ``import manygpu``
costs nothing beyond what is used.
"""

from typing import TYPE_CHECKING

from manygpu import _lazy
from manygpu._version import __version__

if TYPE_CHECKING:
    from manygpu.core import Parallel, ParallelConfig
    from manygpu.errors import CollectiveTimeoutError, LaunchError, ManyGPUError, UsageError
    from manygpu.strategies import (
        CompileOptions,
        DDPOptions,
        FSDPOptions,
        MeshSpec,
        PipelineOptions,
        PSOptions,
        TensorOptions,
    )
    from manygpu.strategies import available as available_strategies

_WHERE = {
    "Parallel": "manygpu.core.parallel",
    "ParallelConfig": "manygpu.core.config",
    "CollectiveTimeoutError": "manygpu.errors",
    "LaunchError": "manygpu.errors",
    "ManyGPUError": "manygpu.errors",
    "UsageError": "manygpu.errors",
    "CompileOptions": "manygpu.strategies.options",
    "DDPOptions": "manygpu.strategies.options",
    "FSDPOptions": "manygpu.strategies.options",
    "PipelineOptions": "manygpu.strategies.options",
    "PSOptions": "manygpu.strategies.options",
    "TensorOptions": "manygpu.strategies.options",
    "MeshSpec": "manygpu.strategies.mesh",
}
_getattr, _dir = _lazy.exports(__name__, _WHERE)


def __getattr__(name: str) -> object:
    if name == "available_strategies":
        from manygpu.strategies import available

        return available
    return _getattr(name)


def __dir__() -> list[str]:
    return sorted([*_dir(), "__version__", "available_strategies"])


__all__ = [
    "CollectiveTimeoutError",
    "CompileOptions",
    "DDPOptions",
    "FSDPOptions",
    "LaunchError",
    "ManyGPUError",
    "MeshSpec",
    "PSOptions",
    "Parallel",
    "ParallelConfig",
    "PipelineOptions",
    "TensorOptions",
    "UsageError",
    "__version__",
    "available_strategies",
]
