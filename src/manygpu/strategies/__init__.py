"""Strategies: how a model, its optimizer and its data are spread over ranks.

Importing this package registers the built-in strategies.
"""

from manygpu.strategies import (  # noqa: F401  (registration)
    ddp,
    dp,
    fsdp,
    model,
    pipeline,
    single,
    tensor,
    zero,
)
from manygpu.strategies.base import Strategy, StrategyOptions
from manygpu.strategies.mesh import MeshSpec, strategy_for_mesh
from manygpu.strategies.options import DDPOptions, FSDPOptions, PipelineOptions, TensorOptions
from manygpu.strategies.registry import available, get_strategy, register

__all__ = [
    "DDPOptions",
    "FSDPOptions",
    "MeshSpec",
    "PipelineOptions",
    "Strategy",
    "StrategyOptions",
    "TensorOptions",
    "available",
    "get_strategy",
    "register",
    "strategy_for_mesh",
]
