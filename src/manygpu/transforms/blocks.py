"""A model's blocks: the one answer to "which submodules are the repeated layers".

FSDP2 shards each block as its own unit, activation checkpointing wraps the
same blocks, and the planner counts them, so a checkpointed region and a
sharded unit are always the same module. Found the way torchtitan does it:

A unit's parameters are gathered together for its forward and freed after, so
units bound peak memory and let one unit's all-gather overlap another's
compute. The standard transformer layout keeps its blocks in a container
(``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential``); containers have
no ``forward`` of their own and cannot be units, so each *block* in them is
one, and the root takes the rest (embeddings, final norm, head).

Tied weights (a head sharing the embedding's matrix, as in GPT-2, T5 and
most Hugging Face models) must live in one unit: a candidate that shares a
parameter with anything outside itself is not made a unit, so the shared
parameter falls to the enclosing one (usually the root).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

BlockClass = type[nn.Module] | str


def _has_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _matches(module: nn.Module, classes: Sequence[BlockClass]) -> bool:
    for cls in classes:
        if isinstance(cls, str):
            if type(module).__name__ == cls:
                return True
        elif isinstance(module, cls):
            return True
    return False


def _container_blocks(root: nn.Module) -> list[nn.Module]:
    """The members of the outermost layer containers (a root Sequential counts)."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, _CONTAINERS):
                blocks.extend(child.children())
            else:
                visit(child)

    if isinstance(root, _CONTAINERS):
        return list(root.children())
    visit(root)
    return blocks


def _outermost_of(root: nn.Module, classes: Sequence[BlockClass]) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if _matches(child, classes):
                found.append(child)
            else:
                visit(child)

    visit(root)
    return found


def _shares_outside(unit: nn.Module, uses: Counter[int]) -> bool:
    """Whether a parameter of ``unit`` is also reached from outside it (a tied weight)."""
    inside = Counter(id(p) for _, p in unit.named_parameters(remove_duplicate=False))
    return any(uses[pid] > count for pid, count in inside.items())


def find_blocks(root: nn.Module, block_classes: Sequence[BlockClass] = ()) -> list[nn.Module]:
    """Submodules to shard as units, innermost first; the root is not in the list.

    ``block_classes`` (classes or class names, e.g. ``"LlamaDecoderLayer"``)
    picks the blocks explicitly; otherwise the members of layer containers
    are blocks and, for a model with no container, its direct children are.
    """
    if block_classes:
        candidates = _outermost_of(root, block_classes)
    else:
        candidates = _container_blocks(root) or list(root.children())
    uses = Counter(id(p) for _, p in root.named_parameters(remove_duplicate=False))
    return [
        c
        for c in candidates
        if not isinstance(c, (nn.ModuleList, nn.ModuleDict))
        and _has_trainable(c)
        and not _shares_outside(c, uses)
    ]


def checkpoint_blocks_of(
    root: nn.Module, block_classes: Sequence[BlockClass] = ()
) -> list[nn.Module]:
    """The blocks activation checkpointing wraps (and the planner counts for it).

    With ``block_classes``: :func:`find_blocks`' choice. Otherwise only members
    of layer containers that are layers of layers: checkpointing a lone
    ``Linear`` keeps its input either way and saves nothing, so a model with no
    block container (a two-Linear MLP, a ``Sequential`` of plain layers) has none.
    """
    if block_classes:
        return find_blocks(root, block_classes)
    inside = {id(b) for b in _container_blocks(root)}
    return [b for b in find_blocks(root) if id(b) in inside and _has_layers(b)]


def _has_layers(module: nn.Module) -> bool:
    """Whether ``module`` holds layers of its own (a block, not one layer)."""
    return any(_has_trainable(child) for child in module.children())
