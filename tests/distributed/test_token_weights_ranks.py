"""``par.backward(loss, tokens=n)`` equals one process's mean over every token of the step.

The zoo's GPT (ModuleList of blocks, tied head), AdamW, ``par.clip_grad_norm_(0.5)``,
3 accumulation micro-steps on 2 and 4 ranks; labels masked with -100 so the micro-steps
and ranks hold very different token counts (16, 3, 0, ...). Each rank backpropagates
the *sum* of its token losses with the count; the reference, in one process, takes
one mean over all the step's tokens. Tolerance 1e-5 (AdamW: 1e-4, as the other
equivalence tests: only summation order differs). The mean of means, what a plain
``par.backward(mean)`` gives, is checked to be far from it: the test would see the bug.
A Hugging Face causal LM (tiny Llama) runs the same in the five-line form, its loss from
``manygpu.token_cross_entropy``; ``par.log``'s ``ratio`` must log one process's step loss.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_harness import preload, run_ranks
from recipes import full_params, max_diff
from zoo import GPT, SEQ, VOCAB, hf_llama

from manygpu import token_cross_entropy

preload("recipes", "zoo", "transformers.models.llama.modeling_llama")

STEPS, MICRO, CLIP, TOL = 2, 3, 0.5, 1e-4
# Tokens each (step, micro-step, data shard) keeps of its 2 x 8 labels, zeros included.
COUNTS = (16, 3, 0, 12, 7, 1, 2, 16, 9, 0, 16, 5, 4, 11, 0, 8, 13)


def _kept(step: int, micro: int, shard: int) -> int:
    return COUNTS[((step * MICRO + micro) * 4 + shard) % len(COUNTS)]


def _batch(step: int, micro: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + shard)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (2, SEQ), generator=g).flatten()
    y[_kept(step, micro, shard) :] = -100  # padding: not counted
    return x, y.view(2, SEQ)


def _loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The GPT's: a plain token-summed cross-entropy; a HF model's: manygpu's helper."""
    out = model(x)
    if hasattr(out, "logits"):
        return token_cross_entropy(out.logits, y)[0]
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


BUILD = {"gpt": GPT, "hf_llama": hf_llama}


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _ranks(strategies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import torch.distributed as dist

    from manygpu import Parallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {}
    for name, case in strategies.items():
        kwargs = {k: v for k, v in case.items() if k != "model"}
        with Parallel(**kwargs, grad_accum_steps=MICRO, timeout_s=60) as par:
            torch.manual_seed(0)
            model = BUILD[case.get("model", "gpt")]()
            model, opt = par.prepare(model, _opt(model))  # the five lines: opt built first
            shard, shards = par.strategy.data_shard()
            logged = []
            for step in range(STEPS):
                summed, counted = 0.0, 0
                for micro in range(MICRO):
                    x, y = _batch(step, micro, shard)
                    loss, tokens = _loss_sum(model, x, y), (y != -100).sum()
                    par.backward(loss, tokens=tokens)
                    summed, counted = summed + float(loss.detach()), counted + int(tokens)
                # The step's loss as one process sees it: every rank's sums over its tokens.
                pair = (summed, counted)
                logged.append(par.log({"loss": pair}, reduce={"loss": "ratio"})["loss"])
                par.clip_grad_norm_(model, CLIP)
                opt.step()
                opt.zero_grad()
            out[name] = {"params": full_params(par.unwrap(model)), "shards": shards,
                         "logged": logged}  # fmt: skip
    return out


def _reference(
    shards: int, token_mean: bool = True, losses: list[float] | None = None, name: str = "gpt"
) -> Any:
    torch.manual_seed(0)
    model = BUILD[name]()
    opt = _opt(model)
    for step in range(STEPS):
        pieces = [_batch(step, m, s) for m in range(MICRO) for s in range(shards)]
        if token_mean:  # one mean over every token of the step
            total = sum(int((y != -100).sum()) for _, y in pieces)
            loss = sum(_loss_sum(model, x, y) for x, y in pieces) / total
        else:  # each piece's own mean, averaged: what weighting by pieces gives
            loss = sum(_loss_sum(model, x, y) / max(int((y != -100).sum()), 1)
                       for x, y in pieces) / len(pieces)  # fmt: skip
        if losses is not None:
            losses.append(float(loss))  # type: ignore[arg-type]
        loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return full_params(model)


CASES = {
    2: {
        **{s: {"strategy": s} for s in ("ddp", "zero1", "fsdp", "zero2", "tensor")},
        # A Hugging Face causal LM (tiny Llama), its labels with -100, manygpu's loss helper.
        **{f"{s}-llama": {"strategy": s, "model": "hf_llama"} for s in ("ddp", "fsdp", "tensor")},
    },
    4: {
        "hsdp": {"strategy": "fsdp", "mesh": {"dp": 2, "fsdp": 2}},
        "dp2xtp2": {"mesh": {"dp": 2, "tp": 2}},
    },
}


@pytest.mark.parametrize("world", list(CASES))
def test_token_weighted_backward_equals_one_mean_over_the_steps_tokens(world: int) -> None:
    ranks = run_ranks(_ranks, world, CASES[world], timeout=300)
    for name in CASES[world]:
        losses: list[float] = []
        model = CASES[world][name].get("model", "gpt")
        want = _reference(ranks[0][name]["shards"], losses=losses, name=model)
        for rank in ranks:
            diff = max_diff(rank[name]["params"], want)
            assert diff < TOL, f"{name}: max |param - one process| = {diff:.2e}"
            # par.log's "ratio": every rank's sums over every rank's tokens, as one process.
            assert rank[name]["logged"] == pytest.approx(losses, rel=1e-5)
    # The bug the weighting fixes is visible at this tolerance: means of means differ.
    assert max_diff(_reference(2, token_mean=False), _reference(2)) > 100 * TOL
