"""Running statistics survive a checkpointed block's recomputation unchanged.

A non-reentrant checkpoint runs a block's forward a second time in the
backward, in training mode, so a BatchNorm (or an InstanceNorm that tracks
running statistics) inside it would fold the same batch into its running mean
and variance twice and count it twice (``num_batches_tracked`` 2 a step): a
CNN's evaluation statistics drift silently. The recomputation must produce the
same outputs (normalised by the batch, as the forward did), so the norms stay
in training mode; what it must not do is move their buffers. The recompute
context therefore copies those buffers before the recomputation and writes
them back after it: exact, and the cost is a few small vectors per norm.

A block without such norms gets the mode's contexts unchanged, and so does a
block traced by ``torch.compile`` (which accepts only selective-checkpointing
contexts there, and functionalises buffer updates into the forward graph).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

Contexts = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


def tracking_norms(block: nn.Module) -> list[nn.Module]:
    """The norms in ``block`` (itself included) whose training forward moves their buffers."""
    return [
        m
        for m in block.modules()
        if isinstance(m, _NormBase) and m.training and m.track_running_stats
    ]


def with_running_stats_kept(block: nn.Module, contexts: Contexts) -> Contexts:
    """``contexts`` (a checkpoint's ``context_fn``) whose recompute context leaves the
    running statistics of ``block``'s norms as the forward left them."""
    if torch.compiler.is_compiling():
        return contexts
    norms = tracking_norms(block)
    if not norms:
        return contexts

    def kept() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        forward, recompute = contexts()
        return forward, _BuffersKept(norms, recompute)

    return kept


class _BuffersKept:
    """Around ``inner``: the norms' buffers copied on entry, written back on exit.

    Written back also when torch stops a recomputation early (it raises once every
    tensor the backward needs is recomputed) or an error ends it. A class, not a
    generator, so that a second backward through the same graph can enter it again.
    """

    def __init__(self, norms: list[nn.Module], inner: AbstractContextManager[Any]) -> None:
        self.norms, self.inner = norms, inner
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self._saved = [
            (b, b.detach().clone()) for m in self.norms for b in m.buffers(recurse=False)
        ]
        self.inner.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> bool | None:
        try:
            return self.inner.__exit__(kind, error, trace)
        finally:
            with torch.no_grad():
                for buffer, before in self._saved:
                    buffer.copy_(before)
            self._saved = []
