"""Models built empty (``par.init_module()``), in one process: what is built, what is refused.

The rank tests (tests/distributed/test_real_models.py, test_big_models.py) show
every strategy training such a model as one process would; these pin down the
pieces and the one-line refusals, cheaply.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model
from torch import nn
from zoo import GPT, gpt_sequential

from manygpu import Parallel, Pipeline
from manygpu.errors import UsageError
from manygpu.transforms.materialize import EmptyModules, empty_init, initialize, place


def test_parameters_are_built_on_meta_and_buffers_stay_real() -> None:
    with Parallel(strategy="single") as par, par.init_module():
        bn = nn.BatchNorm1d(4)
        model = GPT()
    assert all(p.is_meta for p in [*model.parameters(), *bn.parameters()])
    assert not any(b.is_meta for b in bn.buffers())  # running stats: real, as built
    assert model.head.weight is model.wte.weight  # ties survive
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # outside the context: as usual


def test_placing_keeps_a_tied_weight_one_parameter() -> None:
    with empty_init():
        model = GPT()
    place(model, torch.device("cpu"))
    assert model.head.weight is model.wte.weight and not model.head.weight.is_meta
    assert len(list(model.parameters())) == len(list(GPT().parameters()))


def test_init_is_per_module_reproducible_and_the_first_tied_owner_wins() -> None:
    def build() -> nn.Module:
        with empty_init():
            model = GPT()
        empty = EmptyModules.of(model)
        place(model, torch.device("cpu"))
        initialize(empty, seed=5)
        return model

    a, b = build(), build()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    # wte (an Embedding: N(0, 1)) owns the tied weight, as when GPT ties it after building.
    assert a.wte.weight.std().item() == pytest.approx(1.0, rel=0.1)
    assert not torch.equal(a.blocks[0].fc1.weight, a.blocks[1].fc1.weight)  # seeded by name


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)


def test_a_module_without_an_init_is_refused_before_anything_is_allocated() -> None:
    with Parallel(strategy="single") as par:
        with par.init_module():
            model = nn.Sequential(nn.Linear(4, 4), NoInit())
        with pytest.raises(
            UsageError, match=r"module 1 \(NoInit\).*reset_parameters.*weights="
        ) as e:
            par.prepare(model)
        assert "\n" not in str(e.value)


def test_a_model_built_all_on_meta_loses_its_non_persistent_buffers_and_says_so() -> None:
    with Parallel(strategy="single") as par:
        with torch.device("meta"):
            model = Rotary()
        with pytest.raises(UsageError, match=r"freqs.*non-persistent.*par.init_module\(\)"):
            par.prepare(model)


def test_a_model_with_values_given_weights_says_the_file_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "gpt.safetensors"
    torch.manual_seed(0)
    source = GPT()
    save_model(source, str(file))
    with Parallel(strategy="single") as par:
        torch.manual_seed(1)
        model = par.prepare(GPT(), weights=file)
    assert "weights= replaces the values this model was built with" in capsys.readouterr().out
    for p, q in zip(model.parameters(), source.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_timed_pipeline_split_needs_real_values() -> None:
    strategy = Pipeline(loss_fn=nn.functional.cross_entropy, balance="time", example_input=0)
    with Parallel(strategy=strategy) as par:
        with par.init_module():
            model = gpt_sequential()
        with pytest.raises(UsageError, match="balance='params' or give split_points"):
            par.prepare(model)


def test_weights_go_with_one_model() -> None:
    with Parallel(strategy="single") as par, pytest.raises(UsageError, match="one model"):
        par.prepare(nn.Linear(2, 2), nn.Linear(2, 2), weights="x.safetensors")
