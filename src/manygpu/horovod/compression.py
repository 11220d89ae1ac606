"""Gradient compression for all-reduce: ``Compression.none`` and ``Compression.fp16``.

Horovod's interface: a compressor is a class with static ``compress(tensor) ->
(compressed, ctx)`` and ``decompress(compressed, ctx) -> tensor``; ``fp16``
sends floating-point tensors as float16 (half the bytes) and casts them back.
A user's own compressor (a subclass of :class:`Compressor`) works the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Compressor(ABC):
    """Interface of a compression algorithm (static methods, as in Horovod)."""

    @staticmethod
    @abstractmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send, and what ``decompress`` needs to undo it."""

    @staticmethod
    @abstractmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor, back in its original form."""


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16; others as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if isinstance(ctx, torch.dtype) and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """The compressors by name: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
