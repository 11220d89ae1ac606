"""manygpu: from one GPU to every GPU of a machine, and to many machines.

The Python API is one object, :class:`Parallel`; the CLI is ``manygpu``
(``launch``, ``demo``). Names are imported on first use, so ``import manygpu``
costs nothing beyond what is used.
"""

from typing import TYPE_CHECKING

from manygpu import _excepthook, _lazy
from manygpu._version import __version__

_excepthook.install()  # a configuration error is one line, not a traceback

if TYPE_CHECKING:
    from manygpu.core import Parallel, ParallelConfig
    from manygpu.errors import CollectiveTimeoutError, LaunchError, ManyGPUError, UsageError
    from manygpu.strategies import (
        DDP,
        FSDP,
        PS,
        CompileOptions,
        DataParallel,
        MeshSpec,
        ModelParallel,
        Parallelize,
        Pipeline,
        Single,
        Tensor,
        Zero1,
        Zero2,
    )
    from manygpu.strategies import available as available_strategies
    from manygpu.strategies.checkpointing import ActivationCheckpointing

_WHERE = {
    "Parallel": "manygpu.core.parallel",
    "ParallelConfig": "manygpu.core.config",
    "CollectiveTimeoutError": "manygpu.errors",
    "LaunchError": "manygpu.errors",
    "ManyGPUError": "manygpu.errors",
    "UsageError": "manygpu.errors",
    "CompileOptions": "manygpu.strategies.options",
    "ActivationCheckpointing": "manygpu.strategies.checkpointing",
    "DDP": "manygpu.strategies.ddp",
    "Zero1": "manygpu.strategies.ddp",
    "FSDP": "manygpu.strategies.fsdp",
    "Zero2": "manygpu.strategies.fsdp",
    "Tensor": "manygpu.strategies.tensor",
    "Pipeline": "manygpu.strategies.pipeline",
    "Parallelize": "manygpu.strategies.parallelize",
    "PS": "manygpu.strategies.ps",
    "ModelParallel": "manygpu.strategies.model",
    "DataParallel": "manygpu.strategies.dp",
    "Single": "manygpu.strategies.single",
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
    "DDP",
    "FSDP",
    "PS",
    "ActivationCheckpointing",
    "CollectiveTimeoutError",
    "CompileOptions",
    "DataParallel",
    "LaunchError",
    "ManyGPUError",
    "MeshSpec",
    "ModelParallel",
    "Parallel",
    "ParallelConfig",
    "Parallelize",
    "Pipeline",
    "Single",
    "Tensor",
    "UsageError",
    "Zero1",
    "Zero2",
    "__version__",
    "available_strategies",
]
