"""``"pipeline"`` on real gloo ranks matches one process on the same global batch.

Tolerance: max |difference| < 1e-5 in fp32 for losses, gradients and
parameters (the micro-batch sums are only ordered differently). Each stage
keeps the original layer names, so the union of the ranks' state dicts is
compared with the reference model's, key by key.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

from manygpu import Parallel, UsageError
from manygpu.strategies import Pipeline

TOL = 1e-5
STEPS, BATCH, MICRO = 3, 8, 4


def make_deep_model() -> nn.Sequential:
    """Seven layers, the same initial weights in every process."""
    gen = torch.Generator().manual_seed(4321)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4),
    )  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(STEPS * BATCH * 2, 8, generator=gen), torch.randn(
        STEPS * BATCH * 2, 4, generator=gen
    )


def reference(data_shards: int) -> dict[str, object]:
    """Plain torch on the global batch (``data_shards`` replicas' batches together)."""
    model = make_deep_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    losses, grads = [], {}
    glob = BATCH * data_shards
    for step in range(STEPS):
        xs, ys = x[step * glob : (step + 1) * glob], y[step * glob : (step + 1) * glob]
        loss = nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": dict(model.state_dict())}


def _train(mesh: dict[str, int], schedule: str, options: dict[str, object]) -> dict[str, object]:
    opts = Pipeline(
        loss_fn=nn.functional.mse_loss, microbatches=MICRO, schedule=schedule, **options
    )
    par = Parallel(strategy=opts, mesh=mesh)
    try:
        model = par.prepare(make_deep_model())
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        shard, shards = par.strategy.data_shard()
        x, y = data()
        losses, grads = [], {}
        for step in range(STEPS):
            start = (step * shards + shard) * BATCH
            loss = model(x[start : start + BATCH], target=y[start : start + BATCH])
            par.backward(loss)
            if step == 0:
                grads = {k: _full(p.grad) for k, p in par.unwrap(model).named_parameters()}
            losses.append(par.reduce(loss).item())
            opt.step()
            opt.zero_grad()
        model.eval()
        out = model(x[:BATCH])  # every rank gets the last stage's output
        params = {k: _full(v) for k, v in par.unwrap(model).state_dict().items()}
        return {"losses": losses, "grads": grads, "params": params, "eval": out}
    finally:
        par.close()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _check(results: list[dict[str, object]], ref: dict[str, object]) -> None:
    params: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for out in results:
        assert out["losses"] == pytest.approx(ref["losses"], abs=TOL)
        params |= out["params"]
        grads |= out["grads"]
    assert params.keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        assert (params[key] - value).abs().max().item() < TOL, key
        assert (grads[key] - ref["grads"][key]).abs().max().item() < TOL, key
    # Eval output of the trained model, identical on every rank.
    model = make_deep_model()
    model.load_state_dict(ref["params"])
    expected = model(data()[0][:BATCH]).detach()
    for out in results:
        assert (out["eval"] - expected).abs().max().item() < TOL


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_match_no_pipeline(schedule: str) -> None:
    results = run_ranks(_train, 2, {"pp": -1}, schedule, {}, timeout=120)
    _check(results, reference(1))


SEVERAL = ["interleaved-1f1b", "interleaved-zero-bubble", "zbv", "dualpipev"]


def _train_each(mesh: dict[str, int], schedules: list[str]) -> list[dict[str, object]]:
    """One job after another on the same ranks: each schedule's own Parallel."""
    return [_train(mesh, schedule, {}) for schedule in schedules]


def test_two_stages_per_rank_match_no_pipeline_in_every_schedule() -> None:
    """7 layers cut into 4 stages, 2 per rank: looped (interleaved 1F1B, interleaved
    zero bubble) or in a V (ZBV, DualPipeV: rank 0 holds the first and last stage)."""
    ranks = run_ranks(_train_each, 2, {"pp": -1}, SEVERAL, timeout=240)
    ref = reference(1)
    for i, _schedule in enumerate(SEVERAL):
        _check([ranks[0][i], ranks[1][i]], ref)


def test_interleaved_stages_over_dp2_x_pp2_match_the_global_batch() -> None:
    results = run_ranks(_train, 4, {"dp": 2, "pp": 2}, "interleaved-1f1b", {}, timeout=150)
    _check(results, reference(2))


def test_four_stages_with_user_split_points() -> None:
    results = run_ranks(_train, 4, {"pp": 4}, "1f1b", {"split_points": (2, 4, 6)}, timeout=150)
    _check(results, reference(1))


def test_dp2_x_pp2_matches_the_global_batch() -> None:
    example = torch.randn(BATCH, 8)
    opts = {"balance": "time", "example_input": example}
    results = run_ranks(_train, 4, {"dp": 2, "pp": 2}, "1f1b", opts, timeout=150)
    _check(results, reference(2))


def _bad_pipelines() -> list[str]:
    opts = Pipeline(loss_fn=nn.functional.mse_loss, microbatches=MICRO)
    par = Parallel(strategy=opts)
    messages = []
    try:
        for model in (nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)):
            try:
                par.prepare(model)
            except UsageError as exc:
                messages.append(str(exc))
        model = par.prepare(make_deep_model())
        x, y = data()
        try:
            model(x[:6], target=y[:6])  # 6 rows do not make 4 equal micro-batches
        except UsageError as exc:
            messages.append(str(exc))
        loss = model(x[:8], target=y[:8])  # the pipeline still works after refusals
        messages.append(f"loss {par.reduce(loss).item():.6f} {loss.item():.6f}")
    finally:
        par.close()
    return messages


def test_models_that_cannot_be_split_as_asked_get_clear_errors() -> None:
    for messages in run_ranks(_bad_pipelines, 2, timeout=90):
        assert len(messages) == 4, messages
        assert "cannot split 1 layers into 2 stages" in messages[0]
        assert "splits an nn.Sequential into stages" in messages[1]
        assert "batch of 6 does not split into 4 equal micro-batches" in messages[2]
        _, mean, local = messages[3].split()
        assert mean == local  # every rank holds the last stage's loss
