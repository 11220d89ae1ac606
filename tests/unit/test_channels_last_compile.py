"""channels_last and compile in one process: the decisions, the loader, the refusals.

The two-rank equivalence runs (ddp, fsdp; compile with CPU inductor) are in
tests/distributed/test_compile_channels_last.py. Tolerance here: fp32 on the
CPU, channels_last against the default layout, |param difference| < 1e-5.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import manygpu.core.speed as speed
from manygpu import Parallel, PipelineOptions, UsageError
from manygpu.core.data import batch_to_channels_last
from manygpu.core.speed import wants_channels_last
from manygpu.strategies import get_strategy

TOL = 1e-5
CL = torch.channels_last


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
    )  # fmt: skip


def _images() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(16, 3, 6, 6, generator=gen), torch.randint(0, 3, (16,)))


@pytest.mark.parametrize(
    "setting, has_conv, device_type, allowed, expected",
    [
        (None, True, "cuda", True, True),  # the automatic case it is for
        (None, True, "cpu", True, False),  # no change on the CPU
        (None, False, "cuda", True, False),  # nothing to speed up
        (None, True, "cuda", False, False),  # the strategy cannot (pipeline): quietly off
        (True, False, "cpu", True, True),  # forced
        (False, True, "cuda", True, False),  # turned off
    ],
)
def test_when_channels_last_is_used(
    setting: bool | None, has_conv: bool, device_type: str, allowed: bool, expected: bool
) -> None:
    got = wants_channels_last(setting, has_conv=has_conv, device_type=device_type, allowed=allowed)
    assert got is expected


def test_only_image_batches_change_layout() -> None:
    Pair = namedtuple("Pair", "image label")
    img, ids, seq = (
        torch.randn(2, 3, 4, 4),
        torch.zeros(2, 3, 4, 4, dtype=torch.long),
        torch.ones(2, 5),
    )
    out = batch_to_channels_last({"x": [img, ids], "p": Pair(img, seq)})
    assert out["x"][0].is_contiguous(memory_format=CL) and not img.is_contiguous(memory_format=CL)
    assert out["x"][1] is ids and out["p"].label is seq  # integer and 2-D tensors untouched
    assert isinstance(out["p"], Pair) and out["p"].image.is_contiguous(memory_format=CL)
    assert torch.equal(out["x"][0], img)  # same values, another layout


def _train(**fields: object) -> tuple[torch.Tensor, nn.Module, list[bool]]:
    with Parallel(strategy="single", device="cpu", **fields) as par:  # type: ignore[arg-type]
        model = par.prepare(_conv_net())
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        layouts = []
        for x, y in par.prepare(DataLoader(_images(), batch_size=4)):
            layouts.append(x.is_contiguous(memory_format=CL))
            par.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return params, model, layouts


def test_channels_last_trains_the_same_in_one_process() -> None:
    ref, plain, plain_layouts = _train()
    got, model, layouts = _train(channels_last=True)
    assert model[0].weight.is_contiguous(memory_format=CL) and all(layouts)
    # The CPU default (None) changes nothing: default layout, batches as given.
    assert not plain[0].weight.is_contiguous(memory_format=CL) and not any(plain_layouts)
    assert (got - ref).abs().max().item() < TOL


def test_a_loader_prepared_before_its_model_follows_it() -> None:
    with Parallel(strategy="single", device="cpu", channels_last=True) as par:
        loader = par.prepare_loader(DataLoader(_images(), batch_size=4))
        par.prepare(_conv_net())
        x, _ = next(iter(loader))
        assert x.is_contiguous(memory_format=CL)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"strategy": "dp", "compile": True}, "strategy='ddp'"),
        ({"strategy": "model", "compile": True}, "strategy='pipeline'"),
        (
            {"strategy": "pipeline", "channels_last": True,
             "pipeline": PipelineOptions(loss_fn=nn.functional.mse_loss)},
            "channels_last unset or False",
        ),
    ],
)  # fmt: skip
def test_strategies_that_cannot_refuse_in_one_line(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError) as info:
        Parallel(device="cpu", **fields)  # type: ignore[arg-type]
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert "does not work with strategy" in str(info.value)


def test_the_pipeline_is_left_in_its_layout_automatically() -> None:
    assert get_strategy("pipeline").channels_last_refusal is not None
    for name in ("single", "ddp", "zero1", "fsdp", "zero2", "tensor", "dp", "model"):
        assert get_strategy(name).channels_last_refusal is None, name
    # FSDP2 shards only contiguous parameters: there the inputs carry the layout.
    assert not get_strategy("fsdp").channels_last_weights
    assert get_strategy("ddp").channels_last_weights


def test_compile_on_a_cpu_without_a_compiler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speed.shutil, "which", lambda _name: None)
    with pytest.raises(UsageError, match="needs a C\\+\\+ compiler"):
        speed.check_compiler(torch.device("cpu"))
    speed.check_compiler(torch.device("cuda", 0))  # GPUs compile with Triton: nothing to check
