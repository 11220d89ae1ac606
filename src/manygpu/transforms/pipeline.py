"""The order in which ``prepare`` changes a model, written once.

Every change ``prepare`` makes to a user's model is either a *transform*
(this package: it converts the module in place, and may want a word after
each optimizer step or after a load, torchtitan's ``ModelConverter`` shape)
or the strategy's own split / shard / wrap, which only the strategy knows.
:func:`prepare_module` runs them in this order:

1. **one set of weights**: every rank starts from rank 0's values (the
   strategy's source of truth for replicas and shards alike). A model built
   empty (:mod:`.materialize`) has none to send, and a model given
   ``weights=`` gets its values from the file in step 4b: both skip it.
2. **remember the user's parameters** (by name), so an optimizer built
   before ``prepare`` is rebound to whatever replaces them below.
3. **transforms, in order**: channels_last (weights' layout) ->
   activation checkpointing (blocks change class in place, so parameter
   names, tensor-parallel plans and checkpoints see the model unchanged, and
   FSDP2 / DDP / ``compile`` wrap blocks that already checkpoint themselves)
   -> fp8 (``nn.Linear`` -> torchao's ``Float8Linear``, which FSDP2 then
   all-gathers in float8). torchtitan orders TP -> CP -> checkpointing ->
   compile -> FSDP; checkpointing goes first here because it leaves module
   names and parameters untouched, so the tensor split inside the strategy
   sees the same model either way.
4. **the strategy**: its split (tensor / pipeline stages), then sharding or
   replication, then its wrapper (``setup_module``); it calls ``place`` on
   each part it keeps once that part is split, so a model built on the meta
   device is allocated only as this rank's share (:mod:`.materialize`).
4b. **fill**: weights read from ``weights=`` straight into those shards, or
   a model built empty initialised part by part; before any optimizer state
   exists.
5. **the job's hooks on the wrapped model**: the optimizer rebinding, the
   forward's precision, gradient sync for accumulation, the straggler
   clock's probe.
6. **compile**, last, per block where the strategy compiles blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn


class ModelTransform(Protocol):
    """A change of the user's module made before the strategy wraps it."""

    @property
    def name(self) -> str:
        """What it is, in ``prepare``'s messages (e.g. ``"activation checkpointing"``)."""
        ...

    def convert(self, model: nn.Module) -> str | None:
        """Change ``model`` in place; a line to print on the main rank, or ``None``."""
        ...


@dataclass(frozen=True)
class Around:
    """What the job and its strategy do around the transforms (given by ``Parallel``)."""

    sync_weights: Callable[[nn.Module], None]
    """Step 1: every rank's module to rank 0's values."""
    remember: Callable[[nn.Module], None]
    """Step 2: the user's parameters, by name."""
    shard: Callable[[nn.Module], nn.Module]
    """Step 4: the strategy's split, shard, place and wrap; returns the wrapped module."""
    fill: Callable[[nn.Module], None]
    """Step 4b: values for the wrapped module (from a file, or initialised)."""
    hook: Callable[[nn.Module], None]
    """Step 5: the job's hooks on the wrapped module."""
    compile: Callable[[nn.Module], None] | None
    """Step 6 (``None``: the job does not compile)."""


def prepare_module(
    model: nn.Module,
    transforms: Sequence[ModelTransform],
    around: Around,
    say: Callable[[str], None],
) -> nn.Module:
    """``model`` changed by every step of the module docstring, in that order."""
    around.sync_weights(model)
    around.remember(model)
    for transform in transforms:
        line = transform.convert(model)
        if line is not None:
            say(line)
    wrapped = around.shard(model)
    around.fill(wrapped)
    around.hook(wrapped)
    if around.compile is not None:
        around.compile(wrapped)
    return wrapped
