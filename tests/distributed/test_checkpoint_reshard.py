"""A checkpoint saved by 4 ranks loads on 2 ranks and in 1 process, optimizer included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_job import build, train, write_weights
from dist_harness import run_ranks

from manygpu import Parallel


def _save_with_four(directory: str, fmt: str) -> int:
    par = Parallel(strategy="ddp")
    try:
        losses, _ = train(par, directory, 6, every=6, fmt=fmt)
        return len(losses)
    finally:
        par.close()


def _load(directory: str, fmt: str) -> dict[str, object]:
    par = Parallel(strategy="ddp")  # ddp in one process too: a 1-rank group
    try:
        model, opt, _sched, loader, ckpt = build(par, directory, 0, fmt)
        state = ckpt.resume()
        inner = opt.optimizer
        first = inner.state[inner.param_groups[0]["params"][0]]
        return {
            "step": state.step,
            "params": torch.cat([p.detach().reshape(-1) for p in par.unwrap(model).parameters()]),
            "exp_avg": first["exp_avg"].clone(),
            "lr": inner.param_groups[0]["lr"],
            "position": loader.state_dict(),
        }
    finally:
        par.close()


@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_four_ranks_to_two_and_one(tmp_path: Path, fmt: str) -> None:
    directory = str(tmp_path / "ck")
    run_ranks(_save_with_four, 4, directory, fmt, timeout=120)
    on_four = run_ranks(_load, 4, directory, fmt)
    on_two = run_ranks(_load, 2, directory, fmt)
    alone = _load(directory, fmt)
    reference = on_four[0]
    assert reference["step"] == 6
    for got in [*on_two, alone]:
        assert got["step"] == 6
        assert torch.equal(got["params"], reference["params"])
        assert torch.equal(got["exp_avg"], reference["exp_avg"])  # optimizer state resharded
        assert got["lr"] == reference["lr"]
    # 6 steps x 4 ranks x 4 samples = 96 samples = 2 epochs of 48: next epoch, first batch.
    assert reference["position"] == {"epoch": 2, "batches": 0}
    assert alone["position"] == {"epoch": 2, "batches": 0}


def _save_zero1(directory: str) -> torch.Tensor:
    par = Parallel(strategy="zero1")
    try:
        return train(par, directory, 6, every=6, fmt="full")[1]
    finally:
        par.close()


def test_zero1_checkpoint_holds_the_whole_optimizer(tmp_path: Path) -> None:
    # ZeRO-1 shards Adam's state: rank 0 gathers it before a full checkpoint.
    directory = str(tmp_path / "ck")
    trained = run_ranks(_save_zero1, 2, directory, timeout=120)[0]
    alone = _load(directory, "full")
    assert alone["step"] == 6
    assert torch.equal(alone["params"], trained)
    assert alone["exp_avg"].shape == (16, 8) and alone["exp_avg"].abs().sum() > 0


def _fsdp_from_file(directory: str, weights: str, steps: int) -> torch.Tensor:
    """Built empty, read from ``weights``; trains to ``steps`` (resuming what is saved)."""
    with Parallel(strategy="fsdp") as par:
        return train(par, directory, steps, every=6, weights=weights)[1]


def test_a_model_built_empty_resumes_from_its_checkpoint_on_another_world_size(
    tmp_path: Path,
) -> None:
    """fsdp at 4 ranks saves at step 6; at 2 ranks the checkpoint (not the weights file,
    read first by prepare) decides the values: equal to 4 ranks' at step 6, exactly."""
    directory, weights = str(tmp_path / "ck"), write_weights(tmp_path / "w.safetensors")
    saved = run_ranks(_fsdp_from_file, 4, directory, weights, 6, timeout=120)[0]
    resumed = run_ranks(_fsdp_from_file, 2, directory, weights, 6, timeout=120)
    for params in resumed:
        assert torch.equal(params, saved)
    assert not torch.equal(saved, _fsdp_start(weights))  # it trained: the file lost


def _fsdp_start(weights: str) -> torch.Tensor:
    """The file's values, flat in the model's parameter order (as ``train`` returns them)."""
    from safetensors.torch import load_file

    stored = load_file(weights)
    order = ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert sorted(order) == sorted(stored)
    return torch.cat([stored[k].reshape(-1) for k in order])
