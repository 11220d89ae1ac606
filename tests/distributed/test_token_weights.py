"""``par.backward(loss, tokens=n)`` equals one process's mean over every token of the step.

The zoo's GPT (ModuleList of blocks, tied head), AdamW, ``par.clip_grad_norm_(0.5)``,
3 accumulation micro-steps on 2 ranks; labels masked with -100 so the micro-steps
and ranks hold very different token counts (16, 3, 0, ...). Each rank backpropagates
the *sum* of its token losses with the count; the reference, in one process, takes
one mean over all the step's tokens. Tolerance 1e-5 (AdamW: 1e-4, as the other
equivalence tests: only summation order differs). The mean of means, what a plain
``par.backward(mean)`` gives, is checked to be far from it: the test would see the bug.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_harness import preload, run_ranks
from recipes import full_params, max_diff
from zoo import GPT, SEQ, VOCAB

preload("recipes", "zoo")

STEPS, MICRO, CLIP, TOL = 2, 3, 0.5, 1e-4
# Tokens each (step, micro-step, data shard) keeps of its 2 x 8 labels.
KEPT = {
    (0, 0, 0): 16, (0, 0, 1): 3, (0, 1, 0): 0, (0, 1, 1): 12, (0, 2, 0): 7, (0, 2, 1): 1,
    (1, 0, 0): 2, (1, 0, 1): 16, (1, 1, 0): 9, (1, 1, 1): 0, (1, 2, 0): 16, (1, 2, 1): 5,
}  # fmt: skip


def _batch(step: int, micro: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + shard)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (2, SEQ), generator=g).flatten()
    y[KEPT[(step, micro, shard)] :] = -100  # padding: not counted
    return x, y.view(2, SEQ)


def _loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _ranks(strategies: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from manygpu import Parallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {}
    for strategy in strategies:
        with Parallel(strategy=strategy, grad_accum_steps=MICRO, timeout_s=60) as par:
            torch.manual_seed(0)
            model = par.prepare(GPT())
            opt = par.prepare(_opt(model))
            shard, shards = par.strategy.data_shard()
            for step in range(STEPS):
                for micro in range(MICRO):
                    x, y = _batch(step, micro, shard)
                    par.backward(_loss_sum(model, x, y), tokens=(y != -100).sum())
                par.clip_grad_norm_(model, CLIP)
                opt.step()
                opt.zero_grad()
            out[strategy] = {"params": full_params(par.unwrap(model)), "shards": shards}
    return out


def _reference(shards: int, token_mean: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT()
    opt = _opt(model)
    for step in range(STEPS):
        pieces = [_batch(step, m, s) for m in range(MICRO) for s in range(shards)]
        if token_mean:  # one mean over every token of the step
            total = sum(int((y != -100).sum()) for _, y in pieces)
            loss = sum(_loss_sum(model, x, y) for x, y in pieces) / total
        else:  # each piece's own mean, averaged: what weighting by pieces gives
            loss = sum(_loss_sum(model, x, y) / max(int((y != -100).sum()), 1)
                       for x, y in pieces) / len(pieces)  # fmt: skip
        loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return full_params(model)


@pytest.mark.parametrize("world", [2])
def test_token_weighted_backward_equals_one_mean_over_the_steps_tokens(world: int) -> None:
    strategies = ["ddp", "zero1", "fsdp", "zero2", "tensor"]
    ranks = run_ranks(_ranks, world, strategies, timeout=300)
    for strategy in strategies:
        shards = ranks[0][strategy]["shards"]
        want = _reference(shards)
        for rank in ranks:
            diff = max_diff(rank[strategy]["params"], want)
            assert diff < TOL, f"{strategy}: max |param - one process| = {diff:.2e}"
    # The bug the weighting fixes is visible at this tolerance: means of means differ.
    assert max_diff(_reference(2, token_mean=False), _reference(2)) > 100 * TOL
