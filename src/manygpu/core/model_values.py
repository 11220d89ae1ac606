"""Where a prepared model's values come from: rank 0, a weights file, or its own init.

One per ``prepare_model`` call, asked at three steps of
:mod:`manygpu.transforms.pipeline`: before the transforms (rank 0's values
to every rank, for a model built with values), right before the strategy
(what was built empty, by name, and whether it can be initialised: refused
here, before anything is allocated), and after it (``weights=`` read into
this rank's shards, or the empty modules initialised).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from manygpu.comm.module_sync import broadcast_module_state
from manygpu.errors import UsageError
from manygpu.transforms.materialize import (
    EmptyModules,
    check_initializable,
    has_meta,
    initialize,
    meta_buffers,
)
from manygpu.weights import load_weights, state_names
from manygpu.weights.url_sources import resolve


class ModelValues:
    """The values of one model being prepared (see the module docstring)."""

    def __init__(
        self, model: nn.Module, *, weights: str | os.PathLike[str] | None,
        weights_options: dict[str, Any] | None = None, seed: int, device: torch.device,
        timeout_s: float, unwrap: Callable[[nn.Module], nn.Module], say: Callable[[str], None],
    ) -> None:  # fmt: skip
        if weights_options is not None and weights is None:
            raise UsageError("weights_options= are the storage options of weights=; give both")
        if weights is not None:  # a missing fsspec backend: one line before anything is built
            resolve(weights, weights_options)
        self.empty = has_meta(model)
        self.weights, self.weights_options = weights, weights_options
        self._seed, self._device, self._timeout_s, self._unwrap = seed, device, timeout_s, unwrap
        self._modules = EmptyModules(model, ())
        self._names: list[tuple[str, ...]] = []
        self._lost = meta_buffers(model) if self.empty else []
        if self._lost and not callable(getattr(model, "init_weights", None)):
            shown = ", ".join(self._lost[:3])
            raise UsageError(
                f"buffer(s) {shown} are on the meta device and no weights file holds them "
                "(non-persistent): build the model under par.init_module(), which keeps "
                "buffers real, instead of torch.device('meta')"
            )
        if weights is not None and not self.empty:
            say(
                "prepare: weights= replaces the values this model was built with; build it "
                "under par.init_module() to skip making them"
            )

    def sync(self, model: nn.Module) -> None:
        """Step 1: rank 0's values to every rank, unless they come from elsewhere."""
        if not self.empty and self.weights is None:
            broadcast_module_state(model, device=self._device, timeout_s=self._timeout_s)

    def record(self, model: nn.Module) -> None:
        """Before the strategy: the whole model's names, and what was built empty."""
        if self.weights is not None:  # what a weights file is checked against
            self._names = state_names(model)
        if self.empty:
            self._modules = EmptyModules.of(model)
            if self.weights is None or self._lost:
                check_initializable(self._modules)

    def fill(self, wrapped: nn.Module) -> None:
        """After the strategy placed this rank's parts: the file's values, or an init."""
        if self._modules and (self.weights is None or self._lost):
            initialize(self._modules, self._seed)  # init_weights() restores lost buffers
        if self.weights is not None:
            load_weights(
                self._unwrap(wrapped), self.weights, expected=self._names,
                storage_options=self.weights_options, timeout_s=self._timeout_s,
            )  # fmt: skip
