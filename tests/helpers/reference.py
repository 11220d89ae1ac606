"""A tiny model, data, and a plain single-process loop: the reference to match."""

from __future__ import annotations

import torch
from torch import nn

IN, OUT = 8, 4


def make_model() -> nn.Module:
    """Same initial weights in every process (seeded here, not by the caller)."""
    gen = torch.Generator().manual_seed(1234)
    model = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def make_data(n: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=gen), torch.randn(n, OUT, generator=gen)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def reference_train(steps: int, batch: int, accum: int = 1, lr: float = 0.1) -> torch.Tensor:
    """Plain torch: ``steps`` SGD steps on consecutive global batches of ``batch``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = make_data(steps * accum * batch)
    for step in range(steps):
        for micro in range(accum):
            start = (step * accum + micro) * batch
            loss = nn.functional.mse_loss(model(x[start : start + batch]), y[start : start + batch])
            (loss / accum).backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)
