"""``ExpertParallel(...)`` (``"ep"``): a mixture of experts' experts split over the ``ep`` ranks.

Each rank of the ``ep`` group holds ``num_experts / ep`` experts of every MoE
layer (its slice of the stacked expert weights, a DTensor sharded on dim 0, or
its expert modules of an ``nn.ModuleList``: :mod:`.listed`) and reads its own
part of the data ("dp2ep": the degree is borrowed from data
parallelism). A layer's router runs where its tokens are; each routed copy of
a token travels to the rank holding its expert and back with all-to-alls of
uneven sizes, forward and backward. The other parameters are replicated over
every rank (``dp`` x ``ep``) and their gradients averaged, as under DDP.
``Parallel(mesh={"ep": 2})`` picks it; ``{"dp": 2, "ep": 2}`` also replicates
the experts over ``dp``; ``{"fsdp": 2, "ep": 2}`` shards every parameter with
FSDP2 as well (the experts over ``fsdp``, the rest over all ranks: :mod:`.fsdp`).
A block's expert capacity, computed by :class:`.capacity.Capacity`, drops what
one process on the global batch drops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch.nn import Module

from manygpu.checkpoint_io.formats import DCP
from manygpu.errors import UsageError
from manygpu.strategies.costs import CommModel, MemoryModel
from manygpu.strategies.registry import StrategyCard, register
from manygpu.strategies.spec import StrategySpec

if TYPE_CHECKING:
    from manygpu.strategies.base import Strategy

ExpertsPredicate = Callable[[str, Module], bool]
"""``predicate(path, module)``: whether the module at ``path`` is a layer's experts."""


@register
@dataclass(frozen=True, kw_only=True)
class ExpertParallel(StrategySpec):
    """Expert parallelism over ``ep`` (optionally x ``dp`` replicas)."""

    name: ClassVar[str] = "ep"
    # The planner's ways are the ep size; it tries EP for a model described with
    # experts only (ModelDesc.expert_parameters), at ep sizes dividing num_experts.
    card: ClassVar[StrategyCard] = StrategyCard(
        simplicity=11, changes_loop=False, checkpoint=DCP, memory=MemoryModel(experts="ways"),
        comm=CommModel(grads="all_reduce", token_all_to_alls=4), one_process=False,
        plan_ways="axis", ways_option="ep", mesh_axes=("dp", "fsdp", "ep"), mesh_default="ep",
        hybrid_for="ep",
    )  # fmt: skip

    experts: tuple[type | str, ...] | type | str | ExpertsPredicate | None = None
    """Which modules are a layer's experts: classes or class names, or a predicate
    ``(path, module) -> bool``; ``None`` finds them by structure (Hugging Face
    MoE blocks' ``experts``, stacked or an ``nn.ModuleList`` beside a router ``gate``,
    torchtitan-style grouped experts). A named module
    holds its experts' weights stacked (``[num_experts, ...]``) and has either
    forward ``(x, top_k_index, top_k_weights)`` (Hugging Face) or
    ``(x_sorted_by_expert, num_tokens_per_expert)`` (torchtitan)."""

    def __post_init__(self) -> None:
        given = self.experts
        if isinstance(given, (str, type)):
            object.__setattr__(self, "experts", (given,))
        elif given is not None and not callable(given) and not isinstance(given, tuple):
            object.__setattr__(self, "experts", tuple(given))  # a list of names
        if isinstance(self.experts, tuple):
            for cls in self.experts:
                if not isinstance(cls, str) and not (
                    isinstance(cls, type) and issubclass(cls, Module)
                ):
                    raise UsageError(
                        "ExpertParallel(experts=...) takes nn.Module classes, class names or "
                        f"a predicate (path, module) -> bool, not {cls!r}"
                    )

    @classmethod
    def implementation(cls) -> type[Strategy[Any]]:
        from manygpu.strategies.expert.strategy import ExpertParallelStrategy

        return ExpertParallelStrategy
