"""``"model"``: layers over several devices in one process (CPU stages here)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from jobs import two_rank_cluster
from reference import make_data
from torch import nn

from manygpu import ModelParallel, Parallel, UsageError
from manygpu.strategies.splitting import balanced_cuts


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _train(model: nn.Module, opt: torch.optim.Optimizer, backward: object) -> None:
    x, y = make_data(24)
    for i in range(3):
        out = model(x[i * 8 : (i + 1) * 8])  # on the last stage's device (a GPU if any)
        loss = nn.functional.mse_loss(out.cpu(), y[i * 8 : (i + 1) * 8])
        backward(loss)  # type: ignore[operator]
        opt.step()
        opt.zero_grad()


def test_model_parallel_matches_one_device() -> None:
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(ref, ref_opt, lambda loss: loss.backward())
    with Parallel(strategy=ModelParallel(stages=3)) as par:
        model = _model()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        starts = par.strategy.stage_starts  # type: ignore[attr-defined]
        assert len(starts) == 3 and starts[0] == 0
        _train(model, opt, par.backward)
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        # Bit-identical on the CPU; a GPU's kernels round differently (fp32, < 1e-5).
        torch.testing.assert_close(a, b.detach().cpu(), atol=1e-5, rtol=0)


def test_model_parallel_errors() -> None:
    with Parallel(strategy="model") as par, pytest.raises(UsageError, match=r"nn\.Sequential"):
        par.prepare(nn.Linear(2, 2))
    with (
        Parallel(strategy=ModelParallel(stages=9)) as par,
        pytest.raises(UsageError, match="cannot split 5 layers into 9 stages"),
    ):
        par.prepare(_model())
    two = two_rank_cluster()
    with pytest.raises(UsageError, match="launch one process"):
        Parallel(strategy="model", cluster=two)


@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=30), parts=st.integers(1, 8))
def test_balanced_cuts_are_valid(sizes: list[int], parts: int) -> None:
    if parts > len(sizes):
        with pytest.raises(UsageError):
            balanced_cuts(sizes, parts)
        return
    starts = balanced_cuts(sizes, parts)
    assert len(starts) == parts and starts[0] == 0
    assert all(a < b for a, b in itertools.pairwise(starts)) and starts[-1] < len(sizes)
