"""Asynchronous DCP saves on 2 gloo ranks: every rank writes its shards in the background.

- The ranks' background writes are held mid-shard while the training thread
  takes the next step (DDP's all-reduce runs beside DCP's collectives, which
  have a process group of their own); the committed checkpoint holds, bitwise,
  the state of the step the save was asked for.
- A run that saves asynchronously every 5 steps (``dcp``, and ``full``, whose
  other ranks also finish in the background) and stops after step 17 resumes
  at step 15 and ends with the same losses and parameters as a run that never
  stopped.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_job import build, train
from dist_harness import run_ranks
from torch import nn

from manygpu import Parallel
from manygpu.checkpoint import TrainState
from manygpu.checkpoint_io import layout, writer


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of two state trees."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _hold_shard_writes() -> tuple[threading.Event, threading.Event]:
    """This rank's first shard write stops after one buffer until ``go`` is set."""
    started, go = threading.Event(), threading.Event()
    real = writer.DurableFile.write

    def write(self: writer.DurableFile, data: Any) -> int:
        n = real(self, data)
        if self.path.suffix == ".distcp" and not started.is_set():
            started.set()
            assert go.wait(timeout=60), "the test never released the writer"
        return n

    writer.DurableFile.write = write  # type: ignore[method-assign]  # a rank process of its own
    return started, go


def _race(directory: str) -> dict[str, bool]:
    with Parallel(strategy="ddp", timeout_s=60) as par:
        model, opt, _, loader, ckpt = build(par, directory, 0, "dcp", async_save=True)
        batches = iter(loader)

        def step() -> None:
            x, y = next(batches)
            par.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

        step()  # Adam state exists
        module = par.unwrap(model)
        want_model, want_optim = _clone(module.state_dict()), _clone(opt.state_dict())
        started, go = _hold_shard_writes()
        final = ckpt.save(TrainState(step=1))
        try:
            held = started.wait(timeout=60)  # this rank's thread is inside its shard
            committed_early = final.exists()
            step()  # the next step changes what is being saved (an all-reduce too)
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)
        finally:
            go.set()
        ckpt.wait()
        raced = not _same(_clone(module.state_dict()), want_model)
        state = ckpt.resume(1)
        ckpt.close()
        return {
            "held mid-shard": held,
            "not committed while writing": not committed_early,
            "the race was real": raced,
            "resumed step 1": state.step == 1,
            "model as asked": _same(_clone(module.state_dict()), want_model),
            "optimizer as asked": _same(_clone(opt.state_dict()), want_optim),
        }


def test_async_dcp_saves_the_step_it_was_asked_for_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    for rank, checks in enumerate(run_ranks(_race, 2, str(directory), timeout=120)):
        assert all(checks.values()), f"rank {rank}: {checks}"
    found = layout.verify(layout.step_dir(directory, 1))  # both ranks' shards listed
    assert sum(name.endswith(".distcp") for name in found.meta["files"]) == 2


def _train(
    directory: str, total: int, every: int, fmt: str
) -> tuple[dict[int, float], torch.Tensor]:
    with Parallel(strategy="ddp", timeout_s=60) as par:
        return train(par, directory, total, every, fmt=fmt, async_save=every > 0)


@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_async_resume_is_bit_identical_on_two_ranks(tmp_path: Path, fmt: str) -> None:
    ref = run_ranks(_train, 2, str(tmp_path / "ref"), 30, 0, fmt, timeout=120)[0]
    ref_losses, ref_params = ref
    ck = str(tmp_path / "ck")
    run_ranks(_train, 2, ck, 17, 5, fmt, timeout=120)  # "dies" after step 17
    assert [p.name for p in layout.committed(Path(ck))][-1] == "step-00000015"
    losses, params = run_ranks(_train, 2, ck, 30, 5, fmt, timeout=120)[0]  # resumes at 15
    assert min(losses) == 16
    assert all(losses[s] == ref_losses[s] for s in losses)  # exactly the same losses
    assert torch.equal(params, ref_params)
