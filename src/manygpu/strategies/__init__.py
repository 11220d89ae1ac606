"""Strategies: how a model, its optimizer and its data are spread over ranks.

Importing this package registers the built-in strategies.
"""

from manygpu.strategies import ddp, dp, fsdp, model, single, zero  # noqa: F401  (registration)
from manygpu.strategies.base import Strategy, StrategyOptions
from manygpu.strategies.options import DDPOptions, FSDPOptions
from manygpu.strategies.registry import available, get_strategy, register

__all__ = [
    "DDPOptions",
    "FSDPOptions",
    "Strategy",
    "StrategyOptions",
    "available",
    "get_strategy",
    "register",
]
