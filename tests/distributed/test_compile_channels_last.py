"""channels_last and compile=True train exactly as without them, on 2 real gloo ranks.

Each rank runs the same job twice in one process group, with the feature off
and on, and returns the global loss of every step (``par.reduce``, the mean over
ranks) and the final parameters; the two runs must agree. Plain-torch
equivalence of the feature-off run is what tests/distributed/test_real_models.py
checks; here each test also checks the feature really acted (weights or batches
channels_last, graphs compiled), so a feature that silently did nothing fails.

Tolerances, fp32 on the CPU: |loss difference| < 1e-5 and |param difference|
< 1e-5 for both. channels_last runs the same convolutions in another memory
layout (oneDNN's NHWC kernels sum in another order): measured 0 on the losses,
1.5e-8 on the parameters. compile=True (inductor's C++ kernels fuse and reorder
element-wise ops and reductions): measured up to 1.9e-6 on losses of ~20 and
2.4e-7 on the parameters. A missing gradient sync or a dropped step moves both
by ~1e-2.
"""

from __future__ import annotations

import datetime
import shutil
from typing import Any

import pytest
import torch
from dist_harness import preload, run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zoo import GPT, lm_loss

preload("zoo")

pytestmark = pytest.mark.slow

TOL = 1e-5
SAMPLES, BATCH = 24, 4  # per rank: 3 steps of 4 samples at 2 ranks
HAS_CXX = any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
needs_cxx = pytest.mark.skipif(
    not HAS_CXX, reason="torch's CPU inductor needs a C++ compiler (g++/clang++); none found"
)


def conv_net() -> nn.Module:
    """A small ResNet-like stem: conv, BatchNorm, residual conv, pooled linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 4),
    )


def _images() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(SAMPLES, 3, 8, 8, generator=gen), torch.randint(0, 4, (SAMPLES,), generator=gen)
    )


def _tokens() -> TensorDataset:
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 64, (SAMPLES, 9), generator=gen)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


JOBS: dict[str, Any] = {
    # model builder, data, loss, optimizer
    "conv": (conv_net, _images, nn.functional.cross_entropy,
             lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)),
    "gpt": (GPT, _tokens, lm_loss, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)),
}  # fmt: skip


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in module.named_parameters()
    }


def _run(job: str, parallel: dict[str, Any]) -> dict[str, Any]:
    """One training run under ``Parallel(**parallel)``: losses, params, what the feature did."""
    from manygpu import Parallel

    build, data, loss_fn, make_opt = JOBS[job]
    par = Parallel(precision="fp32", **parallel)
    try:
        torch.manual_seed(0)
        model = par.prepare(build())
        opt = par.prepare(make_opt(model))
        loader = par.prepare(DataLoader(data(), batch_size=BATCH))
        losses, layouts = [], []
        for x, y in loader:
            layouts.append(x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
            loss = loss_fn(model(x), y)
            par.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(par.reduce(loss.detach()).item())
        inner = par.unwrap(model)
        weights = [p for p in inner.parameters() if p.dim() == 4]
        return {
            "losses": losses,
            "params": _full(inner),
            "batches_channels_last": all(layouts),
            "weights_channels_last": bool(weights)
            and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights),
            "compiled": [
                name or "model"
                for name, m in [("wrapper", model), *inner.named_modules()]
                if (name != "wrapper" or m is not inner)
                and getattr(m, "_compiled_call_impl", None) is not None
            ],
        }
    finally:
        par.close()


def _spy_ddp_optimizer() -> list[int]:
    """The bucket size of every graph torch's DDPOptimizer splits (it runs only under DDP)."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    calls: list[int] = []
    compile_fn = DDPOptimizer.compile_fn

    def spy(self: Any, gm: Any, example_inputs: Any) -> Any:
        calls.append(self.bucket_bytes_cap)
        return compile_fn(self, gm, example_inputs)

    DDPOptimizer.compile_fn = spy  # type: ignore[method-assign]
    return calls


def _both(job: str, strategy: str, feature: dict[str, Any]) -> dict[str, Any]:
    """The job without and with ``feature``, in one process group (each Parallel borrows it)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        off = _run(job, {"strategy": strategy})
        before, ddp_splits = counters["stats"]["unique_graphs"], _spy_ddp_optimizer()
        on = _run(job, {"strategy": strategy, **feature})
        graphs = counters["stats"]["unique_graphs"] - before
        return {"off": off, "on": on, "graphs": graphs, "ddp_splits": ddp_splits}
    finally:
        dist.destroy_process_group()


def _same_training(out: dict[str, Any]) -> None:
    off, on = out["off"], out["on"]
    assert len(on["losses"]) == len(off["losses"]) == SAMPLES // (2 * BATCH)
    assert on["losses"] == pytest.approx(off["losses"], abs=TOL)
    assert off["losses"][0] != pytest.approx(off["losses"][-1], abs=1e-3)  # it trained
    diff = max((on["params"][k] - off["params"][k]).abs().max().item() for k in off["params"])
    assert diff < TOL, f"max |param difference| = {diff:.2e}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_channels_last_trains_the_same(strategy: str) -> None:
    for out in run_ranks(_both, 2, "conv", strategy, {"channels_last": True}, timeout=240):
        _same_training(out)
        assert out["on"]["batches_channels_last"] and not out["off"]["batches_channels_last"]
        # DDP keeps whole weights: stored NHWC. FSDP2 shards only contiguous
        # parameters: its weights stay, the channels_last inputs carry the layout.
        assert out["on"]["weights_channels_last"] is (strategy == "ddp")
        assert not out["off"]["weights_channels_last"]


@needs_cxx
@pytest.mark.parametrize("fullgraph", [False, True], ids=["compile-True", "fullgraph"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compile_trains_the_same(strategy: str, fullgraph: bool) -> None:
    """``fullgraph=True`` too: neither DDP's forward nor FSDP2's hooks may break a graph."""
    from manygpu import CompileOptions

    feature = {"compile": CompileOptions(fullgraph=True) if fullgraph else True}
    for out in run_ranks(_both, 2, "gpt", strategy, feature, timeout=480):
        _same_training(out)
        assert out["graphs"] > 0 and out["off"]["compiled"] == []
        if strategy == "ddp":
            # Inside the DDP wrapper, after wrapping: DDPOptimizer splits the graph
            # at DDP's 25 MB gradient buckets, so all-reduces overlap the backward.
            assert out["on"]["compiled"] == ["model"]
            assert out["ddp_splits"] and set(out["ddp_splits"]) == {25 * 1024 * 1024}
        else:  # each FSDP2 block, then the root
            assert out["on"]["compiled"] == ["model", "blocks.0", "blocks.1"]
            assert out["ddp_splits"] == []
