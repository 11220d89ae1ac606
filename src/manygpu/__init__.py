"""manygpu: from one GPU to every GPU of a machine, and to many machines.

The Python API is one object, :class:`Parallel`; the CLI is ``manygpu``
(``launch``, ``demo``). Names are imported on first use, so ``import manygpu``
costs nothing beyond what is used; the strategy objects exported are those of
the strategy registry (:data:`manygpu.strategies.registry.OBJECTS`).
"""

from typing import TYPE_CHECKING

from manygpu import _excepthook, _lazy
from manygpu._version import __version__ as __version__
from manygpu.strategies import REMOVED as _REMOVED
from manygpu.strategies import registry as _registry

_excepthook.install()  # a configuration error is one line, not a traceback

if TYPE_CHECKING:  # the names for type checkers; a test keeps them equal to _WHERE
    from manygpu.core import Parallel as Parallel
    from manygpu.core import ParallelConfig as ParallelConfig
    from manygpu.core.losses import token_cross_entropy as token_cross_entropy
    from manygpu.errors import CollectiveTimeoutError as CollectiveTimeoutError
    from manygpu.errors import LaunchError as LaunchError
    from manygpu.errors import ManyGPUError as ManyGPUError
    from manygpu.errors import UsageError as UsageError
    from manygpu.launch.notebook import notebook_launcher as notebook_launcher
    from manygpu.strategies import DDP as DDP
    from manygpu.strategies import FSDP as FSDP
    from manygpu.strategies import PS as PS
    from manygpu.strategies import CompileOptions as CompileOptions
    from manygpu.strategies import DataParallel as DataParallel
    from manygpu.strategies import ExpertParallel as ExpertParallel
    from manygpu.strategies import MeshShape as MeshShape
    from manygpu.strategies import ModelParallel as ModelParallel
    from manygpu.strategies import Parallelize as Parallelize
    from manygpu.strategies import Pipeline as Pipeline
    from manygpu.strategies import Single as Single
    from manygpu.strategies import Tensor as Tensor
    from manygpu.strategies import Zero1 as Zero1
    from manygpu.strategies import Zero2 as Zero2
    from manygpu.strategies import available as available_strategies  # noqa: F401 (__all__)
    from manygpu.transforms.checkpointing import ActivationCheckpointing as ActivationCheckpointing

_WHERE = {
    "Parallel": "manygpu.core.parallel",
    "ParallelConfig": "manygpu.core.config",
    "token_cross_entropy": "manygpu.core.losses",
    "notebook_launcher": "manygpu.launch.notebook",
    "CollectiveTimeoutError": "manygpu.errors",
    "LaunchError": "manygpu.errors",
    "ManyGPUError": "manygpu.errors",
    "UsageError": "manygpu.errors",
    "CompileOptions": "manygpu.strategies.options",
    "ActivationCheckpointing": "manygpu.transforms.checkpointing",
    "MeshShape": "manygpu.strategies.mesh",
    **{name: f"manygpu.strategies.{package}" for name, package in _registry.OBJECTS.items()},
}
_getattr, _dir = _lazy.exports(__name__, _WHERE, _REMOVED)


def __getattr__(name: str) -> object:
    if name == "available_strategies":
        from manygpu.strategies import available

        return available
    return _getattr(name)


def __dir__() -> list[str]:
    return sorted([*_dir(), "__version__", "available_strategies"])


__all__ = sorted([*_WHERE, "__version__", "available_strategies"])
