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
    """Stage start indices splitting ``sizes`` into ``parts`` contiguous, non-empty runs.

    The split minimises the largest stage (the pipeline runs at the pace of
    its slowest stage), so no stage exceeds an even share by more than one
    layer's size; among such splits the one with the smallest sum of squares
    (the most even) wins. Exact dynamic programming: O(layers^2 * parts),
    instant for any real model.
    """
    n = len(sizes)
    if parts > n:
        raise UsageError(
            f"cannot split {n} layers into {parts} stages; use fewer stages "
            "or a model with more layers"
        )
    prefix = [0.0, *itertools.accumulate(float(x) for x in sizes)]
    inf = (float("inf"), float("inf"))
    # best[k][i]: (largest stage, sum of squares) for the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                stage = prefix[i] - prefix[j]
                cand = (max(best[k - 1][j][0], stage), best[k - 1][j][1] + stage * stage)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


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
