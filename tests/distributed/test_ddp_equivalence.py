"""DDP on N real gloo ranks must match one process on the same global batch.

Tolerance: max |difference| of every parameter < 1e-5 after k SGD steps in
fp32 (the only differences are summation order in the all-reduce).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_harness import run_ranks
from reference import flat_params, make_data, make_model, reference_train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manygpu import Parallel
from manygpu.warn import UnpreparedDataWarning

TOL = 1e-5
STEPS = 4
GLOBAL_BATCH = 12  # divisible by 2 and 3


def _ddp_steps(steps: int, batch: int, accum: int, warned: list[str] | None = None) -> torch.Tensor:
    """DDP on tensors each rank slices itself (no loader prepared: the job shards its own
    data, which is what the unprepared-data warning, collected in ``warned``, asks about)."""
    par = Parallel(strategy="ddp", grad_accum_steps=accum)
    try:
        model = make_model()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        per = batch // par.world_size
        x, y = make_data(steps * accum * batch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnpreparedDataWarning)
            for step in range(steps):
                for micro in range(accum):
                    start = (step * accum + micro) * batch + par.rank * per
                    xb, yb = x[start : start + per], y[start : start + per]
                    par.backward(nn.functional.mse_loss(model(xb), yb))
                    opt.step()
                    opt.zero_grad()
        if warned is not None:
            warned += [f"{w.filename}: {w.message}" for w in caught
                       if w.category is UnpreparedDataWarning]  # fmt: skip
        return flat_params(par.unwrap(model))
    finally:
        par.close()


def _ddp_steps_warned(steps: int, batch: int, accum: int) -> tuple[torch.Tensor, list[str]]:
    warned: list[str] = []
    return _ddp_steps(steps, batch, accum, warned), warned


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_single_process(world: int) -> None:
    ref = reference_train(STEPS, GLOBAL_BATCH)
    results = run_ranks(_ddp_steps, world, STEPS, GLOBAL_BATCH, 1)
    for params in results:
        assert (params - ref).abs().max().item() < TOL
    # Every rank ends with exactly the same parameters, not merely close ones.
    for params in results[1:]:
        assert torch.equal(params, results[0])
    assert (ref - flat_params(make_model())).abs().max() > 1e-3  # training moved them


def test_ddp_with_gradient_accumulation_matches() -> None:
    ref = reference_train(STEPS, GLOBAL_BATCH, accum=3)
    results = run_ranks(_ddp_steps_warned, 2, STEPS, GLOBAL_BATCH, 3)
    for params, _ in results:
        assert (params - ref).abs().max().item() < TOL
    # No loader went through prepare: warned once over 4 steps, by rank 0 only, at the
    # user's line, saying how to pass the loader and how a self-sharding job silences it.
    (first, *more), others = results[0][1], results[1][1]
    assert not more and not others, results
    assert first.startswith(__file__) and "no DataLoader went through par.prepare" in first
    assert "par.prepare(model, opt, loader)" in first and "simplefilter('ignore'" in first


def _loader_epochs(strategy: str, batch: int, epochs: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Train through prepared loaders; also return the sample ids seen per epoch."""
    par = Parallel(strategy=strategy, seed=3)
    try:
        x, y = make_data(48)
        ids = torch.arange(48)
        loader = DataLoader(TensorDataset(x, y, ids), batch_size=batch, shuffle=True)
        model = make_model()
        model, opt, loader = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
        seen: list[list[int]] = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnpreparedDataWarning)  # a prepared loader: none
            for _ in range(epochs):
                epoch_ids: list[int] = []
                for xb, yb, ib in loader:
                    par.backward(nn.functional.mse_loss(model(xb), yb))
                    opt.step()
                    opt.zero_grad()
                    epoch_ids += par.gather(ib).tolist()
                seen.append(epoch_ids)
        return flat_params(par.unwrap(model)), seen
    finally:
        par.close()


def test_prepared_loaders_match_single_process_over_epochs() -> None:
    ref, ref_seen = _loader_epochs("single", 12, epochs=2)
    results = run_ranks(_loader_epochs, 2, "ddp", 6, 2)
    for params, seen in results:
        assert (params - ref).abs().max().item() < TOL
        for epoch_ids in seen:  # every sample exactly once per epoch over the ranks
            assert sorted(epoch_ids) == list(range(48))
        assert seen[0] != seen[1]  # a new shuffle each epoch
    # Same global batches as the single process (as sets: order within differs).
    for epoch in range(2):
        ddp_batches = [sorted(results[0][1][epoch][i : i + 12]) for i in range(0, 48, 12)]
        ref_batches = [sorted(ref_seen[epoch][i : i + 12]) for i in range(0, 48, 12)]
        assert ddp_batches == ref_batches


def _uneven(n: int, batch: int) -> tuple[int, float]:
    par = Parallel(strategy="ddp", timeout_s=20)
    try:
        x, y = make_data(n)
        loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
        model = make_model()
        model, opt, loader = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
        steps = 0
        for xb, yb in loader:
            par.backward(nn.functional.mse_loss(model(xb), yb))
            opt.step()
            opt.zero_grad()
            steps += 1
        par.barrier()
        return steps, float(par.reduce(torch.tensor(float(steps)), "max"))
    finally:
        par.close()


def test_uneven_dataset_does_not_hang() -> None:
    # 11 samples over 3 ranks with batch 2: ranks would hold 4, 4, 3 samples;
    # the sampler pads so every rank runs the same number of steps.
    results = run_ranks(_uneven, 3, 11, 2, timeout=60)
    assert [steps for steps, _ in results] == [2, 2, 2]


def _collectives() -> dict[str, list[float]]:
    par = Parallel(strategy="ddp")
    try:
        r = float(par.rank)
        value = torch.tensor([r + 1.0, 10.0 * r])
        out = {
            "sum": par.reduce(value, "sum").tolist(),
            "mean": par.reduce(value, "mean").tolist(),
            "max": par.reduce(value, "max").tolist(),
            "min": par.reduce(value, "min").tolist(),
            "gather": par.gather(torch.tensor([r])).tolist(),
            "unchanged": value.tolist(),
        }
        par.barrier()
        return out
    finally:
        par.close()


def test_reduce_gather_barrier() -> None:
    results = run_ranks(_collectives, 3)
    for rank, out in enumerate(results):
        assert out["sum"] == [6.0, 30.0]
        assert out["mean"] == [2.0, 10.0]
        assert out["max"] == [3.0, 20.0]
        assert out["min"] == [1.0, 0.0]
        assert out["gather"] == [0.0, 1.0, 2.0]
        assert out["unchanged"] == [rank + 1.0, 10.0 * rank]  # reduce returns a new tensor


def _compressed(kind: str) -> torch.Tensor:
    from manygpu import DDP

    par = Parallel(strategy=DDP(grad_compression=kind, bucket_cap_mb=1))
    try:
        model = make_model()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = make_data(24)
        per = 12 // par.world_size
        for step in range(2):
            start = step * 12 + par.rank * per
            par.backward(
                nn.functional.mse_loss(model(x[start : start + per]), y[start : start + per])
            )
            opt.step()
            opt.zero_grad()
        return flat_params(par.unwrap(model))
    finally:
        par.close()


def test_fp16_gradient_compression_stays_close() -> None:
    ref = reference_train(2, 12)
    results = run_ranks(_compressed, 2, "fp16")
    # fp16 keeps ~3 significant digits of each gradient: close, not equal.
    assert (results[0] - ref).abs().max().item() < 1e-2
    assert torch.equal(results[0], results[1])
