"""Activation checkpointing: keep less for the backward, recompute the rest.

``Parallel(activation_checkpointing="full" | "selective" | N)`` applies it to
the model's blocks, found the way FSDP2 finds its units
(:func:`~manygpu.transforms.blocks.find_blocks`, ``block_classes`` picks
them explicitly), so a checkpointed region and a sharded unit are the same
block and a unit's parameters are gathered once for its recomputation.

- ``"full"``: a block keeps only its inputs; its whole forward runs again in
  the backward (about a third more compute for the blocks).
- ``N``: the same for every N-th block (blocks 0, N, 2N, ...), a middle ground.
- ``"selective"``: torch's op-level selective checkpointing: a block keeps the
  outputs of its expensive ops (matmuls, attention, collectives) and recomputes
  only the cheap ones (norms, activations, element-wise), so it saves less
  memory than ``"full"`` for almost no extra compute.

Always torch's non-reentrant checkpoint: the reentrant form runs the backward
of a block inside a second autograd pass, which DDP sees as a parameter
"marked ready twice", and which does not compose with FSDP2 or ``compile``.

Applied first in ``prepare``, before the strategy wraps the model and before
``compile``: the blocks change class in place (the way FSDP2's ``fully_shard``
does), so parameter names, ``state_dict`` keys, tensor-parallel plans and
checkpoints see the model unchanged, and FSDP2 / DDP / ``compile`` wrap a
model whose blocks already checkpoint themselves. The change stays on the
user's model; each apply starts again from the blocks' own classes, so a later
``Parallel`` on the same model gets its own setting (``None``: none).
BatchNorm's running statistics are kept out of the recomputation
(:mod:`.running_stats`).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from manygpu.errors import UsageError
from manygpu.transforms.blocks import BlockClass, checkpoint_blocks_of
from manygpu.transforms.running_stats import with_running_stats_kept

Mode = Literal["full", "selective"]
MODES: tuple[str, ...] = ("full", "selective")


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointing:
    """What ``Parallel(activation_checkpointing=...)`` asks for, as options."""

    mode: Mode = "full"
    """``"full"`` recomputes a block's whole forward; ``"selective"`` keeps the
    outputs of its matmuls and attention and recomputes the cheap ops only."""
    every: int = 1
    """Checkpoint every N-th block (blocks 0, N, 2N, ...); 1 is every block."""
    block_classes: tuple[BlockClass, ...] = ()
    """The blocks, by class or class name (``"LlamaDecoderLayer"``); empty: the
    strategy's own ``block_classes``, else FSDP2's discovery (the members of
    layer containers such as an ``nn.ModuleList`` of transformer blocks)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(unknown_mode(self.mode))
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise UsageError(
                f"activation checkpointing every= takes an integer >= 1, not {self.every!r}"
            )
        if isinstance(self.block_classes, (str, type)):
            object.__setattr__(self, "block_classes", (self.block_classes,))
        for cls in self.block_classes:
            if not isinstance(cls, str) and not (
                isinstance(cls, type) and issubclass(cls, nn.Module)
            ):
                raise UsageError(
                    f"block_classes takes nn.Module classes or class names, not {cls!r}"
                )


def unknown_mode(value: object) -> str:
    """One line for a mode that is none: the nearest one, then every choice."""
    close = difflib.get_close_matches(str(value).lower(), MODES, n=1, cutoff=0.5)
    hint = f" did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown activation_checkpointing {value!r};{hint} choose 'full', 'selective', "
        "every N-th block (an integer >= 1), or None/False (off)"
    )


def parse(value: object) -> ActivationCheckpointing | None:
    """``Parallel(activation_checkpointing=...)`` as options; ``None`` when off."""
    if value is None or value is False:
        return None
    if value is True:
        return ActivationCheckpointing()
    if isinstance(value, ActivationCheckpointing):
        return value
    if isinstance(value, int):
        if value < 1:
            raise UsageError(
                f"activation_checkpointing={value} checkpoints no block: give N >= 1 "
                "(every N-th block), 'full', 'selective' or None"
            )
        return ActivationCheckpointing(every=value)
    if isinstance(value, str):
        return ActivationCheckpointing(mode=value)  # type: ignore[arg-type]
    raise UsageError(unknown_mode(value))


def strategy_block_classes(options: object) -> tuple[BlockClass, ...]:
    """The block classes a strategy's object names for its FSDP2 units (its own
    ``block_classes``, or its composed ``fsdp=FSDP(...)``'s), else none."""
    for holder in (options, getattr(options, "fsdp", None)):
        found = getattr(holder, "block_classes", ())
        if found:
            return tuple(found)
    return ()


def checkpoint_blocks(
    model: nn.Module, spec: ActivationCheckpointing, fallback: Sequence[BlockClass] = ()
) -> list[nn.Module]:
    """Make ``model``'s blocks (every ``spec.every``-th) checkpoint themselves, in place.

    ``fallback``: the strategy's ``block_classes`` when ``spec`` names none.
    Returns the blocks changed; a model without blocks is refused in one line.
    """
    classes = tuple(spec.block_classes) or tuple(fallback)
    blocks = checkpoint_blocks_of(model, classes)
    if not blocks:
        where = (
            f"no module of class {', '.join(map(_name, classes))}"
            if classes
            else "no blocks (layers of layers in an nn.ModuleList or nn.Sequential)"
        )
        raise UsageError(
            f"activation_checkpointing: {type(model).__name__} has {where} to checkpoint; "
            "name its block class, e.g. activation_checkpointing=ActivationCheckpointing("
            "block_classes=('LlamaDecoderLayer',)) or FSDP(block_classes=...), or leave it off"
        )
    chosen = blocks[:: spec.every]
    for block in blocks:  # the latest setting wins: from each block's own class again
        block.__class__ = _base_class(block)
    for block in chosen:
        block.__class__ = _checkpointed_class(type(block), spec.mode)  # type: ignore[arg-type]
    return chosen


def remove(model: nn.Module) -> None:
    """Make every checkpointed block of ``model`` its own class again (checkpointing off)."""
    for module in model.modules():
        base = type(module).__dict__.get("_manygpu_base")
        if base is not None:
            module.__class__ = base


def _base_class(block: nn.Module) -> type[nn.Module]:
    """The class ``block`` had before it was checkpointed (its class if it never was).

    A class derived from a checkpointed one (FSDP2's ``FSDPBlock``, made when it
    sharded the block) cannot be unwound without undoing that wrapper too: such a
    model was prepared already, and is refused.
    """
    cls = type(block)
    if "_manygpu_base" in cls.__dict__:
        return cls.__dict__["_manygpu_base"]
    if getattr(cls, "_manygpu_checkpointed", False):
        raise UsageError(
            f"activation_checkpointing: block {cls.__name__} was wrapped by a strategy "
            "after it was checkpointed (an already prepared model); prepare the unwrapped "
            "model (par.unwrap(model)) or build it again"
        )
    return cls


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Hugging Face's generation cache (by its names across versions), which a decoder
layer appends to in its forward."""


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A training forward's keywords without a key/value cache.

    A layer appends its keys and values to the cache it is given; recomputing it
    in the backward would append them again and see a longer sequence than the
    forward did (torch then refuses the recomputation). Training needs no cache,
    so a checkpointed layer gets none, as Hugging Face's own gradient
    checkpointing does.
    """
    caches = {k for k in _CACHE_KWARGS if _is_cache(kwargs.get(k))}
    if not caches:
        return kwargs
    kept = {k: (None if k in caches else v) for k, v in kwargs.items()}
    if "use_cache" in kept:
        kept["use_cache"] = False
    return kept


def _is_cache(value: object) -> bool:
    """A cache object (not a tensor: a layer's tensor keyword is an input, kept)."""
    return value is not None and not isinstance(value, torch.Tensor | tuple | list)


def _name(cls: BlockClass) -> str:
    return cls if isinstance(cls, str) else cls.__name__


@functools.cache
def _checkpointed_class(base: type[nn.Module], mode: Mode) -> type[nn.Module]:
    """``base`` whose forward runs under a non-reentrant checkpoint in ``mode``.

    It keeps ``base``'s name: FSDP2's and our ``block_classes`` match blocks by
    class name, and a log or a repr should still say ``Block``. Made at run
    time, it cannot be found by name, so it pickles (``torch.save(model)``,
    ``copy.deepcopy``) as "``base`` checkpointed in ``mode``" and is made again
    on load.
    """
    inner = base.forward
    mode_contexts = selective_contexts if mode == "selective" else noop_context_fn

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return inner(self, *args, **kwargs)
        kwargs = _without_cache(kwargs)
        contexts = with_running_stats_kept(self, mode_contexts)
        return checkpoint(inner, self, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        return (_new_checkpointed, (base, mode), self.__getstate__())

    namespace = {
        "forward": forward, "__reduce_ex__": __reduce_ex__, "_manygpu_checkpointed": True,
        "_manygpu_base": base, "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    }  # fmt: skip
    return type(base.__name__, (base,), namespace)


def _new_checkpointed(base: type[nn.Module], mode: Mode) -> nn.Module:
    """An empty block of ``base`` checkpointed in ``mode``, for unpickling to fill."""
    cls = _checkpointed_class(base, mode)  # type: ignore[arg-type]
    return cls.__new__(cls)


def _ops(*names: str) -> frozenset[Any]:
    """The torch ops of those names that this torch has (attention kernels vary by build)."""
    found = set()
    for name in names:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(packet.default)
    return frozenset(found)


SAVED_OPS = _ops(
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten._scaled_mm",
    "aten.convolution",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.all_reduce",
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_to_all_single",
)
"""Ops whose outputs ``"selective"`` keeps: the ones that cost FLOPs or a
network round trip to redo (matmuls, convolutions, attention kernels,
tensor-parallel collectives). Everything else in a block (norms, activations,
element-wise ops, views) is cheap and memory-bound: it is recomputed."""


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """The forward and recompute contexts of ``"selective"`` (a new pair per call, as
    torch requires: each checkpointed forward caches its own saved outputs)."""
    return create_selective_checkpoint_contexts(_policy)


def apply(model: nn.Module, value: object, options: object) -> list[nn.Module]:
    """``Parallel(activation_checkpointing=value)`` on ``model`` under a strategy whose
    object is ``options`` (its ``block_classes`` name the blocks when ``value`` does not)."""
    spec = parse(value)
    if spec is None:  # off, also on a model an earlier Parallel checkpointed
        remove(model)
        return []
    return checkpoint_blocks(model, spec, strategy_block_classes(options))


@dataclass(frozen=True)
class CheckpointBlocks:
    """The model transform (:mod:`.pipeline`): ``apply`` with the job's setting."""

    value: object
    """``Parallel(activation_checkpointing=...)``."""
    options: object
    """The strategy's object (its ``block_classes``, if any)."""

    @property
    def name(self) -> str:
        return "activation checkpointing"

    def convert(self, model: nn.Module) -> str | None:
        """Checkpoint ``model``'s blocks; the line that says which (none when off)."""
        chosen = apply(model, self.value, self.options)
        spec = parse(self.value)
        if spec is None:
            return None
        classes = tuple(spec.block_classes) or strategy_block_classes(self.options)
        return wrapped_line(chosen, spec, len(checkpoint_blocks_of(model, classes)))


def wrapped_line(chosen: Sequence[nn.Module], spec: ActivationCheckpointing, total: int) -> str:
    """``manygpu: activation checkpointing ('full'): 12 GPT2Block``: what was wrapped,
    counted by class (a user sees at once whether those are the layers they meant)."""
    counts: dict[str, int] = {}
    for block in chosen:
        name = type(block).__name__  # the checkpointed class keeps its base's name
        counts[name] = counts.get(name, 0) + 1
    what = ", ".join(f"{n} {name}" for name, n in counts.items())
    every = f", every {spec.every}" if spec.every > 1 else ""
    of = f" of {total} blocks" if len(chosen) < total else ""
    return f"manygpu: activation checkpointing ({spec.mode!r}{every}): {what}{of}"
