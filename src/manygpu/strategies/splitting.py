"""Where to cut an ``nn.Sequential`` into contiguous stages.

Used by ``"model"`` (stages on devices of one process) and ``"pipeline"``
(one stage per rank). Cuts come from the user, or balance parameter counts,
or balance measured forward+backward time per layer.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
from torch import nn

from manygpu.errors import UsageError


def balanced_cuts(sizes: Sequence[float], parts: int) -> list[int]:
    """Stage start indices splitting ``sizes`` into ``parts`` contiguous runs of similar sum."""
    if parts > len(sizes):
        raise UsageError(
            f"cannot split {len(sizes)} layers into {parts} stages; use fewer stages "
            "or a model with more layers"
        )
    total, starts, acc = sum(sizes), [0], 0.0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        remaining_layers = len(sizes) - (i + 1)
        need = parts - len(starts)
        if need and (acc >= total * len(starts) / parts or remaining_layers == need):
            starts.append(i + 1)
    return starts


def starts_from_split_points(points: Sequence[int], layers: int, parts: int) -> list[int]:
    """Validate user split points (where stages 1.. begin) and return stage starts."""
    points = list(points)
    if len(points) != parts - 1:
        raise UsageError(
            f"split_points {points} gives {len(points) + 1} stages but the pipeline has "
            f"{parts}; give {parts - 1} split point(s)"
        )
    bounds = [0, *points, layers]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise UsageError(
            f"split_points {points} must be strictly increasing within 1..{layers - 1} "
            f"(the model has {layers} layers) so that every stage gets at least one layer"
        )
    return [0, *points]


def param_sizes(module: nn.Sequential) -> list[float]:
    """Parameters per layer (parameter-free layers count 1, so they still spread)."""
    return [float(sum(p.numel() for p in layer.parameters()) or 1) for layer in module]


def layer_times(
    module: nn.Sequential, example: torch.Tensor, device: torch.device, repeats: int = 3
) -> list[float]:
    """Seconds of forward + backward per layer on ``example``, best of ``repeats``."""
    best = [float("inf")] * len(module)
    for _ in range(repeats):
        x = example.to(device)
        for i, layer in enumerate(module):
            x = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            y = layer(x)
            if y.requires_grad:
                y.float().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[i] = min(best[i], time.perf_counter() - start)
            x = y
    module.zero_grad(set_to_none=True)
    return best
