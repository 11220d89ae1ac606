"""An optimizer built before prepare is rebound to the parameters a strategy made.

The strategies themselves (FSDP2, tensor, pipeline, ...) are covered on real
ranks by test_real_models' five-line twins; here the rules, on a model whose
parameters are replaced by hand as a sharding strategy replaces them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from manygpu.core.rebind import ParameterRebinder
from manygpu.errors import UsageError


class Tied(nn.Module):
    """An embedding tied to its output head, a block, and a head bias."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.emb.weight


def _replace_all(model: nn.Module) -> None:
    """What a sharding strategy does: every parameter becomes a new tensor (ties kept)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            made.setdefault(id(p), nn.Parameter(p.detach().clone()))
            setattr(module, name, made[id(p)])


def _groups(model: Tied) -> list[dict[str, object]]:
    decay = [model.emb.weight, model.block.weight]
    rest = [model.block.bias, model.head.bias]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def test_old_parameters_are_swapped_in_place_keeping_groups_and_settings() -> None:
    model = Tied()
    opt = torch.optim.AdamW(_groups(model), lr=1e-3, betas=(0.8, 0.9))
    lists = [g["params"] for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    rebinder = ParameterRebinder()
    rebinder.before(model)
    _replace_all(model)
    rebinder.after(model)
    rebinder.rebind(opt)
    assert [g["params"] for g in opt.param_groups] == [
        [model.emb.weight, model.block.weight],
        [model.block.bias, model.head.bias],
    ]
    assert all(a is b["params"] for a, b in zip(lists, opt.param_groups, strict=True))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.defaults["betas"] == (0.8, 0.9)
    opt.step()
    sched.step()  # the scheduler attached before still drives this optimizer
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_a_tied_weight_listed_under_both_names_stays_once() -> None:
    model = Tied()
    opt = torch.optim.SGD([model.emb.weight, model.head.weight, model.block.weight], lr=0.1)
    rebinder = ParameterRebinder()
    rebinder.before(model)
    _replace_all(model)
    rebinder.after(model)
    rebinder.rebind(opt)
    assert opt.param_groups[0]["params"] == [model.emb.weight, model.block.weight]


def test_a_parameter_this_rank_no_longer_holds_leaves_the_optimizer() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rebinder = ParameterRebinder()
    rebinder.before(model)
    stage = nn.Sequential()
    stage.add_module("1", model[1])  # a pipeline's second stage: same names, half the layers
    rebinder.after(stage)
    rebinder.rebind(opt)
    assert opt.param_groups[0]["params"] == list(model[1].parameters())


def test_parameters_of_no_prepared_model_are_left_alone() -> None:
    model, extra = nn.Linear(2, 2), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    rebinder = ParameterRebinder()
    rebinder.before(model)
    _replace_all(model)
    rebinder.after(model)
    rebinder.rebind(opt)
    assert opt.param_groups[0]["params"] == [model.weight, model.bias, extra]


def test_an_optimizer_that_has_stepped_is_refused() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    rebinder = ParameterRebinder()
    rebinder.before(model)
    _replace_all(model)
    rebinder.after(model)
    with pytest.raises(UsageError, match="has stepped"):
        rebinder.rebind(opt)


def test_an_optimizer_built_after_prepare_is_untouched() -> None:
    model = nn.Linear(2, 2)
    rebinder = ParameterRebinder()
    rebinder.before(model)
    _replace_all(model)
    rebinder.after(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [list(g["params"]) for g in opt.param_groups]
    rebinder.rebind(opt)
    assert [g["params"] for g in opt.param_groups] == before
