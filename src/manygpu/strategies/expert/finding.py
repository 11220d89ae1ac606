"""Which modules of a model are a mixture of experts' experts, and how they are called.

Plain logic over a module tree (no process group), so it is tested without
ranks and refuses a model before any all-to-all. An experts module holds the
weights of all its layer's experts stacked on dim 0 (``[num_experts, ...]``)
and is called one of two ways:

- ``routed``: ``forward(x, top_k_index, top_k_weights)`` - Hugging Face's
  ``MixtralExperts``, ``Qwen2MoeExperts``, ... (transformers 5 stacks them):
  tokens in their order, each with its ``k`` experts and their weights;
- ``grouped``: ``forward(x, num_tokens_per_expert)`` - torchtitan's
  ``GroupedExperts``: the routed copies already sorted by expert, with counts.

Found by structure: a module called ``experts`` by its parent (or whose class
name contains ``Experts``) whose own parameters are all 3-D with one leading
size, and no sub-module with parameters. Anything else is named by the user
(``ExpertParallel(experts=...)``).

A third layout, ``listed``, keeps one module per expert: an ``nn.ModuleList``
called ``experts`` of identical expert MLPs (transformers 4.x Mixtral,
Qwen2-MoE and Qwen3-MoE, many hand-written models). Its parent - the sparse
block - is what runs under EP (:mod:`.listed`), so it must look like those
blocks: a router ``gate`` (``nn.Linear`` to ``num_experts``) and ``top_k``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from manygpu.errors import UsageError

Kind = Literal["routed", "grouped", "listed"]


@dataclass(frozen=True)
class ExpertsSite:
    """One layer's experts: where they are, how many, and how they are called."""

    path: str
    """The module's name in the model (``model.layers.0.mlp.experts``)."""
    kind: Kind
    num_experts: int
    params: tuple[str, ...]
    """Its stacked weights' names (``gate_up_proj``, ``down_proj``); for ``listed``,
    one expert's (``w1.weight``, ...)."""
    top_k: int = 0
    """``listed``: the block's experts per token (0 for the stacked layouts)."""


def stacked_size(module: nn.Module) -> int | None:
    """The leading size its own parameters share, when they are all 3-D and it has no
    sub-module with parameters; ``None`` otherwise."""
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() != 3 for p in own):
        return None
    if any(True for c in module.children() for _ in c.parameters()):
        return None
    sizes = {p.shape[0] for p in own}
    return sizes.pop() if len(sizes) == 1 else None


def call_kind(module: nn.Module) -> Kind | None:
    """``routed`` for ``forward(x, top_k_index, top_k_weights)``, ``grouped`` for
    ``forward(x, num_tokens_per_expert)``, from its signature; ``None`` otherwise."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "num_tokens_per_expert" in names or (len(names) == 2 and not _has_var(params)):
        return "grouped"
    if "top_k_index" in names or len(names) == 3:
        return "routed"
    return None


def _has_var(params: Any) -> bool:
    return any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _by_structure(path: str, module: nn.Module) -> bool:
    leaf = path.rsplit(".", 1)[-1]
    if isinstance(module, nn.ModuleList):
        return leaf == "experts" and len(module) > 0
    named = leaf == "experts" or "Experts" in type(module).__name__
    return named and stacked_size(module) is not None


def _matcher(chosen: Any) -> Any:
    """``(path, module) -> bool`` from the option: a predicate, classes or class names."""
    if chosen is None:
        return _by_structure
    if callable(chosen) and not isinstance(chosen, (tuple, type)):
        return chosen
    wanted = (chosen,) if isinstance(chosen, (str, type)) else tuple(chosen)

    def named(path: str, module: nn.Module) -> bool:
        return any(
            type(module).__name__ == w if isinstance(w, str) else isinstance(module, w)
            for w in wanted
        )

    return named


def find_experts(model: nn.Module, chosen: Any = None) -> list[ExpertsSite]:
    """Every experts module of ``model`` (outermost matches), or a one-line refusal."""
    match = _matcher(chosen)
    sites: list[ExpertsSite] = []
    taken: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(t + ".") for t in taken) or not match(path, module):
            continue
        taken.append(path)
        if isinstance(module, nn.ModuleList):
            sites.append(listed_site(model, path, module))
            continue
        sites.append(_site(path, module, named=chosen is not None))
        _refuse_capacity(f"{path} ({type(module).__name__})", _parent(model, path))
    if not sites:
        raise UsageError(_none_found(model, chosen))
    return sites


def _site(path: str, module: nn.Module, *, named: bool) -> ExpertsSite:
    where = f"{path or 'the model'} ({type(module).__name__})"
    size = stacked_size(module)
    if size is None:
        raise UsageError(
            f"strategy 'ep' cannot split {where}: its experts' weights must be stacked "
            "3-D parameters [num_experts, ...] of its own, or an nn.ModuleList of expert "
            "modules called 'experts'; stack them, or name another module with experts="
        )
    kind = call_kind(module)
    if kind is None:
        raise UsageError(
            f"strategy 'ep' cannot call {where}: its forward must be (x, top_k_index, "
            "top_k_weights) or (x, num_tokens_per_expert)"
            + ("" if named else "; name your experts with ExpertParallel(experts=...)")
        )
    names = tuple(n for n, _ in module.named_parameters(recurse=False))
    return ExpertsSite(path=path, kind=kind, num_experts=size, params=names)


def listed_site(model: nn.Module, path: str, experts: nn.ModuleList) -> ExpertsSite:
    """A ModuleList of experts and its block, checked as the module docstring says."""
    block = _parent(model, path)
    where = f"{path} ({type(block).__name__}.experts, {len(experts)} experts)"
    kinds = {(type(e), tuple((n, p.shape) for n, p in e.named_parameters())) for e in experts}
    if len(kinds) != 1 or not next(iter(kinds))[1]:
        raise UsageError(
            f"strategy 'ep' cannot split {where}: its experts must be modules of one class "
            "with parameters of the same shapes; name the stacked experts with experts="
        )
    gate, top_k = getattr(block, "gate", None), getattr(block, "top_k", None)
    if not isinstance(gate, nn.Linear) or gate.out_features != len(experts):
        raise UsageError(
            f"strategy 'ep' cannot route {where}: its block needs a router 'gate' "
            f"(nn.Linear to {len(experts)} experts) as Mixtral's and Qwen-MoE's have"
        )
    if not isinstance(top_k, int) or not 0 < top_k <= len(experts):
        raise UsageError(
            f"strategy 'ep' cannot route {where}: its block needs 'top_k' (experts per "
            f"token, 1 to {len(experts)}), not {top_k!r}"
        )
    if getattr(block, "jitter_noise", 0):
        raise UsageError(
            f"strategy 'ep' cannot route {where}: its router's jitter_noise is random, "
            "so it cannot match one process; set jitter_noise=0"
        )
    _refuse_capacity(where, block)
    names = tuple(n for n, _ in experts[0].named_parameters())
    return ExpertsSite(path, "listed", len(experts), names, top_k=top_k)


def _parent(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path.rpartition(".")[0]) if path else model


def _refuse_capacity(where: str, block: nn.Module) -> None:
    """Capacity limits (tokens past an expert's capacity dropped) are not run under EP."""
    from manygpu.strategies.expert.capacity import Capacity

    for module in block.modules():
        factor = getattr(module, "capacity_factor", None)
        if factor is not None and not isinstance(module, Capacity):
            raise UsageError(
                f"strategy 'ep' cannot run {where}: it drops tokens past a capacity "
                f"(capacity_factor={factor}) from its rank's tokens alone; compute the drops "
                "with manygpu.strategies.expert.capacity.Capacity, or set capacity_factor=None"
            )


def _none_found(model: nn.Module, chosen: Any) -> str:
    if chosen is not None:
        return (
            f"strategy 'ep' found no module matching experts={chosen!r} in "
            f"{type(model).__name__}; name the class of the module holding a layer's experts"
        )
    return (
        f"strategy 'ep' found no experts in {type(model).__name__} (a module called "
        "'experts' with stacked 3-D weights [num_experts, ...], or an nn.ModuleList of "
        "experts beside a router 'gate'); name them: "
        "ExpertParallel(experts='MyExperts') or experts=lambda path, module: ..."
    )


def check_divisible(sites: list[ExpertsSite], ep: int) -> None:
    """Each layer's experts must split evenly over the ``ep`` ranks."""
    for site in sites:
        if site.num_experts % ep:
            raise UsageError(
                f"cannot split the {site.num_experts} experts of {site.path!r} over ep={ep}: "
                "num_experts must be a multiple of ep; change the mesh's ep size"
            )
