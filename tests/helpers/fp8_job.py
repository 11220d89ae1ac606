"""A few steps of the zoo's GPT under ``Parallel``: fp8 (emulated on the CPU) or bf16.

Used in one process by tests/unit/test_fp8.py and on every rank by
tests/distributed/test_fp8_ranks.py. The global batch is the same whatever the
world size: rank r trains on rows [r*B/world, (r+1)*B/world) of it, so a
data-parallel run equals one process up to float8 scaling (see the tests).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch
from zoo import OPTIMIZERS, ZOO

from manygpu import Parallel

STEPS, BATCH = 4, 8


def _losses(par: Parallel, model: torch.nn.Module, opt: Any) -> list[float]:
    entry = ZOO["gpt"]
    x, y = entry.data(STEPS * BATCH, torch.Generator().manual_seed(3))
    share = BATCH // par.world_size
    losses = []
    for step in range(STEPS):
        lo = step * BATCH + par.rank * share
        loss = entry.loss(model(x[lo : lo + share]), y[lo : lo + share])
        par.backward(loss)
        opt.step()
        opt.zero_grad()
        total = par.reduce(loss.detach(), op="mean") if par.world_size > 1 else loss.detach()
        losses.append(float(total))
    return losses


def train_gpt(strategy: str, precision: str, weights: str | None = None) -> dict[str, Any]:
    """Train; the losses, full fp32 parameters and what the layers became.

    With ``weights`` the model is built empty (``init_module``: converted to fp8 on
    the meta device, sharded, then allocated) and read from that file.
    """
    assert os.environ.get("MANYGPU_FP8_EMULATE") == "1", "set by the test (no FP8 GPU here)"
    with Parallel(strategy=strategy, precision=precision, device="cpu") as par:
        with par.init_module() if weights else contextlib.nullcontext():
            model = ZOO["gpt"].build()
        # SGD, not Adam: a parameter's difference is its gradient's (Adam's g / sqrt(v)
        # blows a tiny gradient's rounding up to a full step).
        model, opt = par.prepare(model, OPTIMIZERS["sgd_nesterov"](model), weights=weights)
        losses = _losses(par, model, opt)
        layers = {n: type(m).__name__ for n, m in par.unwrap(model).named_modules()}
        params = {}
        for name, p in par.unwrap(model).named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[name] = full.detach().clone().float()
    return {"losses": losses, "params": params, "layers": layers}


def train_gpt_strategies(strategies: list[str]) -> dict[str, dict[str, Any]]:
    """:func:`train_gpt` in fp8 under each strategy in turn, in this process;
    ``"fsdp+weights"``: fsdp, built empty and read from rank 0's model as a file."""
    return {
        name: train_gpt(name.split("+")[0], "fp8", _rank0_file() if "+" in name else None)
        for name in strategies
    }


def _rank0_file() -> str:
    """The model rank 0 builds (Parallel seeds rank r with r), as a safetensors file."""
    from safetensors.torch import save_model

    torch.manual_seed(0)
    path = os.path.join(tempfile.mkdtemp(prefix="fp8-weights-"), "gpt.safetensors")
    save_model(ZOO["gpt"].build(), path)
    return path
