"""channels_last: 4-D weights and image batches stored NHWC, where convolutions run faster.

A decision (:func:`wants_channels_last`, pure: tests pass any device's facts)
and the in-place change of the model (:func:`to_channels_last`), applied in
``prepare`` before any wrapping where the strategy keeps whole weights; the
prepared loaders convert image batches to match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def has_conv2d(model: nn.Module) -> bool:
    """Whether ``model`` contains a 2-D convolution (what channels_last speeds up)."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def wants_channels_last(
    setting: bool | None, *, has_conv: bool, device_type: str, allowed: bool
) -> bool:
    """Whether a model runs channels_last (a pure decision).

    ``setting`` is the config's: ``None`` turns it on for conv models on CUDA
    where the strategy allows it, ``True``/``False`` force it (a strategy that
    cannot do it has refused ``True`` already).
    """
    if setting is not None:
        return setting
    return has_conv and device_type == "cuda" and allowed


def to_channels_last(model: nn.Module) -> nn.Module:
    """``model`` with its 4-D parameters and buffers stored channels_last (in place)."""
    # nn.Module.to takes memory_format, though its typed overloads do not say so.
    return model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]


@dataclass
class ChannelsLast:
    """The model transform (:mod:`.pipeline`); :attr:`chosen` says whether the model
    runs channels_last (then the prepared loaders convert image batches too)."""

    setting: bool | None
    """``Parallel(channels_last=...)``."""
    device_type: str
    allowed: bool
    """Whether the strategy can run channels_last at all."""
    weights: bool
    """Whether the strategy keeps whole weights (their layout is changed here)."""
    chosen: bool = False

    @property
    def name(self) -> str:
        return "channels_last"

    def convert(self, model: nn.Module) -> str | None:
        conv = has_conv2d(model)
        self.chosen = wants_channels_last(
            self.setting, has_conv=conv, device_type=self.device_type, allowed=self.allowed
        )
        if self.chosen and self.weights:
            to_channels_last(model)  # in place: the user's module stays the one we hold
        return None
