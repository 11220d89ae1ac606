"""channels_last and compile in one process: the decisions, the loader, the refusals.

The two-rank equivalence runs (ddp, fsdp; compile with CPU inductor) are in
tests/distributed/test_compile_channels_last.py. Here one process with
channels_last trains the zoo's BatchNorm ResNet as plain eager torch in the
default layout does, with AdamW (decay / no-decay groups), warmup + cosine,
gradient clipping and a short last batch. Tolerance (fp32, CPU): losses within
1e-5 relative, parameters within 1e-5 (oneDNN's NHWC kernels sum in another
order: measured 2e-7; a dropped scheduler step moves them by ~1e-2), the gradient
norms that clipping sees within 1e-5 relative.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from recipes import INIT_SEED, full_params, max_diff
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zoo import OPTIMIZERS, ZOO, dataset, warmup_cosine

import manygpu.core.speed as speed
from manygpu import Parallel, Pipeline, UsageError
from manygpu.core.data import batch_to_channels_last
from manygpu.strategies import get_strategy
from manygpu.transforms.channels_last import wants_channels_last

LOSS_TOL, PARAM_TOL = 1e-5, 1e-5
CL = torch.channels_last
CLIP, STEPS = 0.3, 4


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


def _loader() -> DataLoader:
    """14 samples in batches of 4, 4, 4, 2: the last one short, as at the end of an epoch."""
    return DataLoader(dataset("resnet", 14), batch_size=4)


def _reference() -> dict[str, Any]:
    """The recipe in plain eager torch, default memory layout: losses, norms, final parameters."""
    torch.manual_seed(INIT_SEED)
    model = ZOO["resnet"].build()
    opt = OPTIMIZERS["adamw"](model)  # decay / no-decay groups
    sched = warmup_cosine(opt, STEPS)
    losses, norms = [], []
    for x, y in _loader():
        loss = ZOO["resnet"].loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": full_params(model)}


def _train(**fields: object) -> tuple[dict[str, Any], nn.Module, list[bool]]:
    """The same recipe under ``Parallel(strategy="single", **fields)``."""
    with Parallel(strategy="single", device="cpu", precision="fp32", **fields) as par:  # type: ignore[arg-type]
        torch.manual_seed(INIT_SEED)
        model = par.prepare(ZOO["resnet"].build())
        opt, loader = par.prepare(OPTIMIZERS["adamw"](model), _loader())
        sched = warmup_cosine(opt, STEPS)
        losses, norms, layouts = [], [], []
        for x, y in loader:
            layouts.append(x.is_contiguous(memory_format=CL))
            loss = ZOO["resnet"].loss(model(x), y)
            par.backward(loss)
            norms.append(float(par.clip_grad_norm_(model, CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "norms": norms, "params": full_params(model)}, model, layouts


def test_channels_last_trains_as_plain_torch_in_one_process() -> None:
    ref = _reference()
    got, model, layouts = _train(channels_last=True)
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=CL) for w in convs) and all(layouts)
    assert len(got["losses"]) == STEPS and ref["losses"][0] != pytest.approx(ref["losses"][-1])
    assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_TOL)
    assert got["norms"] == pytest.approx(ref["norms"], rel=LOSS_TOL)
    assert sum(n > CLIP for n in ref["norms"]) >= 2, f"clipping seldom active: {ref['norms']}"
    diff = max_diff(got["params"], ref["params"])
    assert diff < PARAM_TOL, f"max |param - reference| = {diff:.2e}"
    # The CPU default (None) changes nothing: default layout, batches as given.
    _, plain, plain_layouts = _train()
    plain_convs = [m.weight for m in plain.modules() if isinstance(m, nn.Conv2d)]
    assert not any(w.is_contiguous(memory_format=CL) for w in plain_convs)
    assert not any(plain_layouts)


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
            {"strategy": Pipeline(loss_fn=nn.functional.mse_loss), "channels_last": True},
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
