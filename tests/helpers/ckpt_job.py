"""A small training job with dropout, shuffling, Adam and an LR schedule, checkpointed.

Used in-process, on gloo ranks and under ``manygpu launch`` to check that a
resumed run is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manygpu import Parallel
from manygpu.checkpoint import Checkpointer


def build(
    par: Parallel,
    directory: str | Path,
    every: int,
    fmt: str | None = None,
    async_save: bool = False,
    batch: int = 4,
    weights: str | None = None,
):
    """The job's parts; with ``weights``, the model is built empty (``par.init_module()``)
    and its values read from that file by ``prepare`` (see :func:`write_weights`)."""
    torch.manual_seed(0)
    with par.init_module() if weights else contextlib.nullcontext():
        model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(48, 8, generator=gen), torch.randn(48, 4, generator=gen))
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    model, opt, loader = par.prepare(model, opt, loader, weights=weights)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ckpt = Checkpointer(
        par,
        directory,
        model=model,
        optimizer=opt,
        scheduler=sched,
        loader=loader,
        every=every,
        format=fmt,
        async_save=async_save,
    )
    return model, opt, sched, loader, ckpt


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 4))


def write_weights(path: str | Path) -> str:
    """The model :func:`build` makes without ``weights``, as a safetensors file."""
    from safetensors.torch import save_model

    torch.manual_seed(0)
    save_model(_model(), str(path))
    return str(path)


def train(
    par: Parallel,
    directory: str | Path,
    total: int,
    every: int,
    *,
    kill_at: int = -1,
    fmt: str | None = None,
    async_save: bool = False,
    sleep_s: float = 0.0,
    started: str | None = None,
    fresh_ok: bool = False,
    weights: str | None = None,
) -> tuple[dict[int, float], torch.Tensor]:
    """Train to ``total`` steps (resuming if a checkpoint exists); (losses, flat params)."""
    model, opt, sched, loader, ckpt = build(par, directory, every, fmt, async_save, weights=weights)
    state = ckpt.resume(fresh_ok=fresh_ok)
    losses: dict[int, float] = {}
    while state.step < total:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            par.backward(loss)
            opt.step()
            opt.zero_grad()
            sched.step()
            state.step += 1
            losses[state.step] = float(par.reduce(loss.detach(), "mean"))
            if started and par.is_main:
                Path(started).write_text(str(state.step))
            ckpt.after_step(state)
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if state.step == kill_at and first_attempt and par.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a worker dies mid-epoch
            time.sleep(sleep_s)
            if state.step >= total:
                break
    ckpt.close()
    params = torch.cat([_whole(p).detach().reshape(-1) for p in par.unwrap(model).parameters()])
    return losses, params


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A sharded parameter gathered (a collective: every rank calls it in order)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p
