"""The fused optimizer step: same math as the unfused one, chosen only when the user did not.

Fused AdamW/Adam/SGD kernels run on the CPU in this torch, so the switch
``Parallel`` makes on CUDA is exercised here and compared with the unfused step
(tolerance 1e-6 after several steps with two param groups: the kernels differ
only in the order of fp32 operations). The CUDA-only decision takes the
parameters' device types as input, so it is tested with ``{"cuda"}`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from reference import make_data, make_model
from torch import nn

from manygpu import Parallel
from manygpu.core.precision import PrecisionPlugin
from manygpu.core.speed import fused_step_applies, param_device_types, use_fused_step

TOL = 1e-6
STEPS = 6

MakeOpt = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, MakeOpt] = {
    "adamw": lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05),
    "adam-amsgrad": lambda g: torch.optim.Adam(g, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "sgd-nesterov": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True),
    "sgd-plain": lambda g: torch.optim.SGD(g, lr=0.05, weight_decay=1e-3),
}


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups with their own hyper-parameters: the fused kernel must honour each."""
    children = list(model.children())
    first, last = children[0], children[-1]
    return [{"params": list(first.parameters()), "lr": 3e-2}, {"params": list(last.parameters())}]


def _train(make: MakeOpt, fused: bool, precision: str = "fp32") -> tuple[torch.Tensor, Any]:
    model = make_model()
    opt = make(_groups(model))
    if fused:
        assert fused_step_applies(opt, {"cuda"})  # what Parallel asks on a GPU
        use_fused_step(opt)
    plugin = PrecisionPlugin(precision, torch.device("cpu"))
    x, y = make_data(STEPS * 8)
    for i in range(STEPS):
        with plugin.autocast():
            out = model(x[i * 8 : (i + 1) * 8])
        loss = nn.functional.mse_loss(out.float(), y[i * 8 : (i + 1) * 8])
        plugin.scale(loss).backward()
        plugin.step(opt)
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_step_equals_unfused(name: str) -> None:
    ref, plain = _train(OPTIMIZERS[name], fused=False)
    got, fused = _train(OPTIMIZERS[name], fused=True)
    assert all(g["fused"] is True for g in fused.param_groups)
    assert all(g["fused"] is None for g in plain.param_groups)
    assert (got - ref).abs().max().item() < TOL
    assert (ref - torch.cat([p.reshape(-1) for p in make_model().parameters()])).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_fused_step_with_the_fp16_grad_scaler(name: str) -> None:
    """The scaler hands its scale to the fused kernel (as for ``fused=True``): same result."""
    ref, _ = _train(OPTIMIZERS[name], fused=False, precision="fp16")
    got, fused = _train(OPTIMIZERS[name], fused=True, precision="fp16")
    assert fused._step_supports_amp_scaling
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, foreach=False),
        lambda p: torch.optim.AdamW(p, fused=False),
        lambda p: torch.optim.Adam(p, foreach=True),
        lambda p: torch.optim.SGD(p, lr=0.1, fused=False),
        lambda p: torch.optim.SGD(p, lr=0.1, foreach=False),
    ],
    ids=["adamw-foreach-False", "adamw-fused-False", "adam-foreach-True", "sgd-fused-False",
         "sgd-foreach-False"],
)  # fmt: skip
def test_a_users_own_choice_is_kept(make: Callable[[Any], torch.optim.Optimizer]) -> None:
    opt = make(make_model().parameters())
    before = [dict(g, params=None) for g in opt.param_groups]
    assert not fused_step_applies(opt, {"cuda"})
    assert [dict(g, params=None) for g in opt.param_groups] == before


def test_a_choice_made_in_one_group_is_kept() -> None:
    model = make_model()
    groups = _groups(model)
    groups[1]["foreach"] = False
    assert not fused_step_applies(torch.optim.AdamW(groups), {"cuda"})


class MyAdamW(torch.optim.AdamW):
    """A subclass may override step() and ignore the group's "fused" flag."""


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.RMSprop(p),
        lambda p: torch.optim.Adagrad(p),
        lambda p: torch.optim.NAdam(p),
        lambda p: MyAdamW(p),
        lambda p: torch.optim.Adam(p, differentiable=True),
    ],
    ids=["rmsprop", "adagrad", "nadam", "subclass", "differentiable"],
)
def test_other_optimizers_are_left_alone(make: Callable[[Any], torch.optim.Optimizer]) -> None:
    assert not fused_step_applies(make(make_model().parameters()), {"cuda"})


def test_only_when_every_parameter_is_on_cuda() -> None:
    opt = torch.optim.AdamW(make_model().parameters())
    assert param_device_types(opt) == {"cpu"}
    assert fused_step_applies(opt, {"cuda"})
    assert not fused_step_applies(opt, {"cpu"})
    assert not fused_step_applies(opt, {"cuda", "cpu"})  # e.g. part offloaded


def test_not_after_the_optimizer_has_stepped() -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    model(make_data(2)[0]).sum().backward()
    opt.step()
    assert not fused_step_applies(opt, {"cuda"})


def test_cpu_jobs_keep_the_optimizer_as_given() -> None:
    """On the CPU (every parameter there) Parallel changes nothing: no behaviour change."""
    with Parallel(strategy="single", device="cpu") as par:
        model = par.prepare(make_model())
        opt = par.prepare(torch.optim.AdamW(model.parameters()))
        assert opt.defaults["fused"] is None
        assert all(g["fused"] is None for g in opt.param_groups)
