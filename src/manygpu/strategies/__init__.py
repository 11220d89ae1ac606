"""Strategies: how a model, its optimizer and its data are spread over ranks.

Each strategy is a package here whose object carries its options
(``FSDP(param_dtype="bf16")``) and is listed in :data:`.registry.OBJECTS`, the
one list the names below derive from. Like ``manygpu`` itself, this package
imports a name on its first use: the registry and the cards cost no torch, and
the class doing the work is imported when a job uses it.
"""

from typing import TYPE_CHECKING

from manygpu import _lazy
from manygpu.strategies.registry import OBJECTS

if TYPE_CHECKING:  # the names for type checkers; a test keeps them equal to OBJECTS
    from manygpu.strategies.base import JobOptions as JobOptions
    from manygpu.strategies.base import Strategy as Strategy
    from manygpu.strategies.ddp import DDP as DDP
    from manygpu.strategies.ddp import Zero1 as Zero1
    from manygpu.strategies.dp import DataParallel as DataParallel
    from manygpu.strategies.expert import ExpertParallel as ExpertParallel
    from manygpu.strategies.fsdp import FSDP as FSDP
    from manygpu.strategies.fsdp import Zero2 as Zero2
    from manygpu.strategies.mesh import MeshShape as MeshShape
    from manygpu.strategies.model import ModelParallel as ModelParallel
    from manygpu.strategies.options import CompileOptions as CompileOptions
    from manygpu.strategies.parallelize import Parallelize as Parallelize
    from manygpu.strategies.pipeline import Pipeline as Pipeline
    from manygpu.strategies.ps import PS as PS
    from manygpu.strategies.registry import add_package as add_package
    from manygpu.strategies.registry import available as available
    from manygpu.strategies.registry import card as card
    from manygpu.strategies.registry import default_strategy as default_strategy
    from manygpu.strategies.registry import get_strategy as get_strategy
    from manygpu.strategies.registry import register as register
    from manygpu.strategies.registry import serving_strategy as serving_strategy
    from manygpu.strategies.registry import spec_class as spec_class
    from manygpu.strategies.registry import strategy_for_mesh as strategy_for_mesh
    from manygpu.strategies.single import Single as Single
    from manygpu.strategies.spec import StrategySpec as StrategySpec
    from manygpu.strategies.tensor import Tensor as Tensor

MACHINERY: dict[str, str] = {
    "JobOptions": "manygpu.strategies.base",
    "Strategy": "manygpu.strategies.base",
    "MeshShape": "manygpu.strategies.mesh",
    "strategy_for_mesh": "manygpu.strategies.registry",
    "CompileOptions": "manygpu.strategies.options",
    "StrategySpec": "manygpu.strategies.spec",
    **{f: "manygpu.strategies.registry" for f in (
        "add_package", "available", "card", "default_strategy", "get_strategy", "register",
        "serving_strategy", "spec_class",
    )},
}  # fmt: skip
"""What the package exports beside the strategy objects: the interface, the registry's
functions and the shared machinery, by the module each lives in."""
REMOVED: dict[str, str] = {
    f"{name}Options": f"use {name}(...), the strategy object that carries its options"
    for name in ("DDP", "FSDP", "Pipeline", "Tensor", "PS")
}
"""The options classes' names of the pre-release API, never shipped."""
_WHERE = {**{n: f"{__name__}.{p}" for n, p in OBJECTS.items()}, **MACHINERY}
__getattr__, __dir__ = _lazy.exports(__name__, _WHERE, REMOVED)


__all__ = sorted(_WHERE)
