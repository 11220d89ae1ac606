"""The Python API: :class:`Parallel` and its configuration."""

from manygpu.core.config import ParallelConfig
from manygpu.core.parallel import Parallel

__all__ = ["Parallel", "ParallelConfig"]
