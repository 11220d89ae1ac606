"""Strategies: how a model, its optimizer and its data are spread over ranks.

Every strategy is listed in :mod:`.registry` and imported when it is looked
up (:func:`get_strategy`), so this package costs no more than torch itself.
"""

from manygpu.strategies.base import Strategy, StrategyOptions
from manygpu.strategies.mesh import MeshSpec, strategy_for_mesh
from manygpu.strategies.options import (
    CompileOptions,
    DDPOptions,
    FSDPOptions,
    PipelineOptions,
    PSOptions,
    TensorOptions,
)
from manygpu.strategies.registry import (
    available,
    card,
    default_strategy,
    get_strategy,
    register,
    serving_strategy,
)

__all__ = [
    "CompileOptions",
    "DDPOptions",
    "FSDPOptions",
    "MeshSpec",
    "PSOptions",
    "PipelineOptions",
    "Strategy",
    "StrategyOptions",
    "TensorOptions",
    "available",
    "card",
    "default_strategy",
    "get_strategy",
    "register",
    "serving_strategy",
    "strategy_for_mesh",
]
