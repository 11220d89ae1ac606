"""Strategies: how a model, its optimizer and its data are spread over ranks.

Each strategy is a package here whose object carries its options
(``FSDP(param_dtype="bf16")``) and is listed in :mod:`.registry`; the class
doing the work is imported when a job uses it, so this package costs no more
than torch itself.
"""

from manygpu.strategies.base import JobOptions, Strategy
from manygpu.strategies.ddp import DDP, Zero1
from manygpu.strategies.dp import DataParallel
from manygpu.strategies.fsdp import FSDP, Zero2
from manygpu.strategies.mesh import MeshSpec, strategy_for_mesh
from manygpu.strategies.model import ModelParallel
from manygpu.strategies.options import CompileOptions
from manygpu.strategies.parallelize import Parallelize
from manygpu.strategies.pipeline import Pipeline
from manygpu.strategies.ps import PS
from manygpu.strategies.registry import (
    add_package,
    available,
    card,
    default_strategy,
    get_strategy,
    register,
    serving_strategy,
    spec_class,
)
from manygpu.strategies.single import Single
from manygpu.strategies.spec import StrategySpec
from manygpu.strategies.tensor import Tensor

__all__ = [
    "DDP",
    "FSDP",
    "PS",
    "CompileOptions",
    "DataParallel",
    "JobOptions",
    "MeshSpec",
    "ModelParallel",
    "Parallelize",
    "Pipeline",
    "Single",
    "Strategy",
    "StrategySpec",
    "Tensor",
    "Zero1",
    "Zero2",
    "add_package",
    "available",
    "card",
    "default_strategy",
    "get_strategy",
    "register",
    "serving_strategy",
    "spec_class",
    "strategy_for_mesh",
]
