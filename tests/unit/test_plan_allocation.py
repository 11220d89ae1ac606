"""The planner's bytes against what manygpu really allocates, counted after one AdamW step.

In-process: ``Parallel`` on this CPU (a one-rank gloo group for FSDP2). Parameters,
gradients and optimizer state are compared piece by piece and must match exactly
(tolerance: 0 bytes; Adam's 0-dim ``step`` counters, 4 bytes per tensor, are not
counted by the planner and not here). The 16-bit weight copies autocast keeps for
the backward are compared with the planner's ``gathered`` bound.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from manygpu import FSDP, Parallel
from manygpu.plan import memory
from manygpu.plan.desc import ModelDesc
from manygpu.plan.recipe import Recipe


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))  # fmt: skip


def _bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    out = 0
    for t in tensors:
        if t is not None and t.dim() > 0:
            local = t.to_local() if isinstance(t, DTensor) else t
            out += local.numel() * local.element_size()
    return out


def _one_step(strategy: object, precision: str) -> tuple[nn.Module, dict[str, int]]:
    """Prepare, run one step, count what is held, and the bf16 weight-shaped tensors
    saved for backward that are still allocated when the forward ends."""
    par = Parallel(strategy=strategy, precision=precision, device="cpu", seed=None)
    try:
        model = _model()
        model, opt = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        shapes = {tuple(p.shape) for p in _model().parameters() if p.dim() == 2}
        saved: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(torch.randn(4, 64)).sum()
        # Still allocated once the forward is over (FSDP2 frees its resharded units).
        copies = sum(storage.nbytes() for storage in saved.values())
        par.backward(loss)
        opt.step()
        state = opt.optimizer.state.values()
        held = {
            "params": _bytes(model.parameters()),
            "grads": _bytes(p.grad for p in model.parameters()),
            "optimizer": _bytes(v for s in state for v in s.values()),
            "copies": copies,
        }
        return model, held
    finally:
        par.close()


def _estimate(strategy: str, precision: str) -> memory.MemoryEstimate:
    model = _model()
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    desc = ModelDesc(name="mlp", parameters=sum(p.numel() for p in model.parameters()),
                     largest_layer_parameters=max(own))  # fmt: skip
    return memory.estimate(desc, strategy, world=1, batch=4, precision=precision,
                           optimizer="adamw")  # fmt: skip


def test_bf16_single_is_autocast_over_fp32_weights_as_planned() -> None:
    _, held = _one_step("single", "bf16")
    est = _estimate("single", "bf16")
    assert (held["params"], held["grads"], held["optimizer"]) == (
        est.params, est.grads, est.optimizer,
    )  # fmt: skip
    # Autocast's bf16 copies of the weights, kept for the backward: within the planner's
    # bound (every weight), and more than half of it (all but the first layer's here).
    assert 0.5 * est.gathered < held["copies"] <= est.gathered


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp_with_param_dtype_keeps_fp32_shards_as_planned(precision: str) -> None:
    recipe = Recipe(strategy="fsdp", world=1, ways=1, precision=precision)
    want = 'FSDP(param_dtype="bf16")' if precision == "bf16" else '"fsdp"'
    assert want in recipe.parallel_line()  # what the planner counts is what runs here
    option = FSDP(param_dtype="bf16") if recipe.low_precision_params else FSDP()
    model, held = _one_step(option, precision)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    est = _estimate("fsdp", precision)
    assert (held["params"], held["grads"], held["optimizer"]) == (
        est.params, est.grads, est.optimizer,
    )  # fmt: skip
    # The gathered units are bf16 already (autocast casts nothing) and freed after their
    # forward: what is left of them is within the planner's two units.
    assert held["copies"] <= est.gathered
