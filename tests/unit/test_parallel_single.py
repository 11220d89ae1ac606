"""The Parallel API in one process (world size 1): every strategy matches plain torch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from jobs import two_rank_cluster
from reference import flat_params, make_data, make_model, reference_train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manygpu import Parallel
from manygpu.core.data import PreparedLoader
from manygpu.core.optimizer import PreparedOptimizer
from manygpu.errors import UsageError

TOL = 1e-6
STEPS = 3
BATCH = 8


def _train(par: Parallel, steps: int, batch: int, accum: int = 1) -> torch.Tensor:
    """``steps`` optimizer steps of ``accum`` micro-batches of ``batch`` samples each."""
    model = make_model()
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(steps * accum * batch)
    for i in range(steps * accum):
        xb, yb = x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
        par.backward(nn.functional.mse_loss(model(xb), yb))
        opt.step()
        opt.zero_grad()
    return flat_params(par.unwrap(model))


def _model_and_opt(par: Parallel) -> tuple[nn.Module, PreparedOptimizer]:
    model = make_model()
    return par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _ids(loader: PreparedLoader) -> list[int]:
    return [i for (batch,) in loader for i in batch.tolist()]


@pytest.mark.filterwarnings("ignore:strategy 'dp':UserWarning")
@pytest.mark.parametrize("strategy", ["single", "dp", "ddp"])
def test_strategy_matches_plain_torch(strategy: str) -> None:
    ref = reference_train(STEPS, BATCH)
    with Parallel(strategy=strategy, device="cpu") as par:
        assert par.world_size == 1 and par.rank == 0 and par.is_main
        params = _train(par, STEPS, BATCH)
    assert (params - ref).abs().max().item() < TOL
    assert (ref - flat_params(make_model())).abs().max().item() > 1e-3  # training moved them


def test_ddp_creates_and_destroys_its_own_group() -> None:
    with Parallel(strategy="ddp", device="cpu") as par:
        assert dist.is_initialized()
        assert dist.get_world_size() == 1
        model = par.prepare(make_model())
        assert isinstance(model, nn.parallel.DistributedDataParallel)
        assert par.unwrap(model) is model.module
    assert not dist.is_initialized()


def test_single_creates_no_group() -> None:
    with Parallel(strategy="single", device="cpu"):
        assert not dist.is_initialized()


def test_dp_warns_to_use_ddp() -> None:
    with Parallel(strategy="dp", device="cpu") as par:
        with pytest.warns(UserWarning, match="'ddp' is faster"):
            model = par.prepare(make_model())
        assert par.unwrap(model) is model  # on the CPU there is nothing to split over


def test_accumulation_equals_double_batch() -> None:
    ref = reference_train(STEPS, 2 * BATCH)
    with Parallel(strategy="single", device="cpu", grad_accum_steps=2) as par:
        params = _train(par, STEPS, BATCH, accum=2)
    assert (params - ref).abs().max().item() < TOL


def test_sync_gradients_follows_accumulation() -> None:
    with Parallel(strategy="single", device="cpu", grad_accum_steps=2) as par:
        model = par.prepare(make_model())
        x, y = make_data(4)
        synced = []
        for _ in range(4):
            par.backward(nn.functional.mse_loss(model(x), y))
            synced.append(par.sync_gradients)
    assert synced == [False, True, False, True]


def test_bf16_layers_run_in_bf16_and_the_output_is_fp32() -> None:
    """The layers compute in bf16; the user's loss, outside autocast, gets fp32
    (on CUDA a bf16 output broke ``mse_loss(out, fp32_target)`` in backward)."""
    with Parallel(strategy="single", device="cpu", precision="bf16") as par:
        model, opt = _model_and_opt(par)
        inner: list[torch.dtype] = []
        first = next(m for m in model.modules() if isinstance(m, nn.Linear))
        first.register_forward_hook(lambda _m, _i, o: inner.append(o.dtype))
        x, y = make_data(BATCH)
        out = model(x)
        assert inner == [torch.bfloat16]
        assert out.dtype == torch.float32
        before = flat_params(model)
        par.backward(nn.functional.mse_loss(out, y))
        opt.step()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert not torch.equal(before, flat_params(model))


def test_fp16_scales_loss_and_still_trains() -> None:
    with Parallel(strategy="single", device="cpu", precision="fp16") as par:
        assert par.precision.scaler is not None
        model, opt = _model_and_opt(par)
        x, y = make_data(32)
        losses = []
        for _ in range(20):
            loss = nn.functional.mse_loss(model(x).float(), y)
            losses.append(loss.item())
            par.backward(loss)
            opt.step()
            opt.zero_grad()
    assert losses[-1] < 0.9 * losses[0]


def test_fp32_has_no_scaler() -> None:
    with Parallel(strategy="single", device="cpu") as par:
        assert par.precision.scaler is None
        assert par.prepare(make_model())(make_data(2)[0]).dtype == torch.float32


def test_prepare_keeps_order_and_unwraps_one() -> None:
    data = TensorDataset(torch.arange(8))
    with Parallel(strategy="single", device="cpu") as par:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = par.prepare(opt, DataLoader(data, batch_size=2), model)
        assert isinstance(out, tuple) and len(out) == 3
        assert isinstance(out[0], PreparedOptimizer)
        assert isinstance(out[1], PreparedLoader)
        assert out[2] is model
        alone = par.prepare(make_model())
        assert isinstance(alone, nn.Module)


def test_prepare_rejects_other_objects() -> None:
    with Parallel(strategy="single", device="cpu") as par, pytest.raises(TypeError, match="str"):
        par.prepare("model")


def test_eval_loader_sees_each_sample_once() -> None:
    data = TensorDataset(torch.arange(10))
    with Parallel(strategy="single", device="cpu") as par:
        loader = par.prepare_loader(DataLoader(data, batch_size=3, shuffle=True), train=False)
        first, second = _ids(loader), _ids(loader)
    assert sorted(first) == list(range(10))
    assert len(first) == 10
    assert second == first


def test_train_loader_reshuffles_and_set_epoch_replays() -> None:
    data = TensorDataset(torch.arange(32))
    with Parallel(strategy="single", device="cpu") as par:
        loader = par.prepare(DataLoader(data, batch_size=4, shuffle=True))
        epoch0, epoch1 = _ids(loader), _ids(loader)
        loader.set_epoch(0)
        replay = _ids(loader)
    assert sorted(epoch0) == sorted(epoch1) == list(range(32))
    assert epoch0 != epoch1
    assert replay == epoch0


def test_lr_scheduler_accepts_prepared_optimizer() -> None:
    with Parallel(strategy="single", device="cpu") as par:
        model, opt = _model_and_opt(par)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        x, y = make_data(4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                par.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
                sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
        assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
        assert not [w for w in caught if "lr_scheduler" in str(w.message)]


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_single_process_strategy_rejects_world_of_two(strategy: str) -> None:
    fake = two_rank_cluster()
    with pytest.raises(UsageError, match="use strategy='ddp'"):
        Parallel(strategy=strategy, device="cpu", cluster=fake)
    assert not dist.is_initialized()


def test_epoch_end_closes_partial_accumulation_cycle() -> None:
    x, y = make_data(8)
    with Parallel(strategy="single", device="cpu", grad_accum_steps=3) as par:
        model = par.prepare(make_model())
        loader = par.prepare(DataLoader(TensorDataset(x, y), batch_size=2))
        synced = []
        for _ in range(2):
            for xb, yb in loader:
                par.backward(nn.functional.mse_loss(model(xb), yb))
                synced.append(par.sync_gradients)
    # 4 batches per epoch: one full cycle of 3, then the last batch ends the epoch's cycle.
    assert synced == [False, False, True, True] * 2


def test_fp16_clip_grad_norm_sees_unscaled_gradients() -> None:
    x, y = make_data(BATCH)
    plain = make_model()
    nn.functional.mse_loss(plain(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 1e9).item()
    with Parallel(strategy="single", device="cpu", precision="fp16") as par:
        model, _opt = _model_and_opt(par)
        par.backward(nn.functional.mse_loss(model(x).float(), y))
        norm = par.clip_grad_norm_(model, 1e9).item()
    assert norm == pytest.approx(expected, rel=2e-2)


def test_collectives_are_local_in_one_process() -> None:
    with Parallel(strategy="ddp", device="cpu") as par:
        value = torch.tensor([1.0, 2.0])
        reduced = par.reduce(value, "sum")
        assert torch.equal(reduced, value) and reduced is not value
        assert par.gather(torch.tensor(3.0)).tolist() == [3.0]
        par.barrier()


def test_prepared_optimizer_supports_step_hooks() -> None:
    calls: list[int] = []
    with Parallel(strategy="single", device="cpu") as par:
        _model, opt = _model_and_opt(par)
        opt.register_step_post_hook(lambda *_: calls.append(1))
        opt.step()
    assert calls == [1]


def test_unprepared_data_is_warned_only_where_data_is_split_and_no_loader_was_prepared() -> None:
    """The rule behind the first step's warning (tests/distributed/test_ddp_equivalence.py
    sees it fire on two ranks); one process, or a prepared loader, never warns."""
    from manygpu.core.preparing import unprepared_data

    assert unprepared_data(shards=1, loaders=0) is None  # single, tensor, pipeline peers
    assert unprepared_data(shards=4, loaders=1) is None
    why = unprepared_data(shards=4, loaders=0)
    assert why is not None and "splits data over 4 ranks" in why and "\n" not in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(Parallel(strategy="single"), 2, BATCH)  # world size 1: nothing to split
