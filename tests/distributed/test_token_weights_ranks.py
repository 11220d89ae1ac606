"""``par.backward(loss, tokens=n)`` equals one process's mean over every token of the step.

The zoo's GPT (ModuleList of blocks, tied head), AdamW, ``par.clip_grad_norm_(0.5)``,
3 accumulation micro-steps on 2 and 4 ranks; labels masked with -100 so the micro-steps
and ranks hold very different token counts (16, 3, 0, ...). Each rank backpropagates
the *sum* of its token losses with the count; the reference, in one process, takes
one mean over all the step's tokens. Tolerance 1e-5 (AdamW: 1e-4, as the other
equivalence tests: only summation order differs). The mean of means, what a plain
``par.backward(mean)`` gives, is checked to be far from it: the test would see the bug.
A Hugging Face causal LM (tiny Llama) runs the same in the five-line form, its loss from
``manygpu.token_cross_entropy``, under ddp, fsdp and tensor (the GPT covers every strategy
and mesh; the Llama adds the HF model's loss and tensor plan to one of each family:
replicated, sharded, DTensor); ``par.log``'s ``ratio`` must log one process's step loss.
Each reference is computed once per data width and model, in the pytest process.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_harness import preload, run_ranks
from recipes import full_params, max_diff
from zoo import GPT, SEQ, VOCAB, gpt_sequential, hf_llama

from manygpu import token_cross_entropy

# zero1's ZeroRedundancyOptimizer pulls in torch.distributed.optim (~0.4 CPU-s a rank).
preload("recipes", "zoo", "transformers.models.llama.modeling_llama", "torch.distributed.optim")

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


_REFERENCES: dict[tuple[int, str, bool], tuple[dict[str, torch.Tensor], list[float]]] = {}


def _reference(
    shards: int, name: str = "gpt", token_mean: bool = True
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process's parameters after the steps, and its step losses (computed once)."""
    key = (shards, name, token_mean)
    if key not in _REFERENCES:
        losses: list[float] = []
        _REFERENCES[key] = (_train_reference(shards, name, token_mean, losses), losses)
    return _REFERENCES[key]


def _train_reference(
    shards: int, name: str, token_mean: bool, losses: list[float]
) -> dict[str, torch.Tensor]:
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
        losses.append(float(loss.detach()))  # type: ignore[union-attr]
        loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return full_params(model)


CASES = {
    2: {
        **{s: {"strategy": s} for s in ("ddp", "zero1", "fsdp", "zero2", "tensor")},
        # A Hugging Face causal LM (tiny Llama), its labels with -100, manygpu's loss helper.
        # zero1 and zero2 with it would repeat ddp's and fsdp's paths through the model.
        **{f"{s}-llama": {"strategy": s, "model": "hf_llama"} for s in ("ddp", "fsdp", "tensor")},
    },
    # The meshes on the GPT: the Llama's sharded and tensor plans are checked above.
    4: {
        "hsdp": {"strategy": "fsdp", "mesh": {"dp": 2, "fsdp": 2}},
        "dp2xtp2": {"mesh": {"dp": 2, "tp": 2}},
    },
}


@pytest.mark.parametrize("world", list(CASES))
def test_token_weighted_backward_equals_one_mean_over_the_steps_tokens(world: int) -> None:
    ranks = run_ranks(_ranks, world, CASES[world], timeout=300)
    for name in CASES[world]:
        model = CASES[world][name].get("model", "gpt")
        want, losses = _reference(ranks[0][name]["shards"], model)
        for rank in ranks:
            diff = max_diff(rank[name]["params"], want)
            assert diff < TOL, f"{name}: max |param - one process| = {diff:.2e}"
            # par.log's "ratio": every rank's sums over every rank's tokens, as one process.
            assert rank[name]["logged"] == pytest.approx(losses, rel=1e-5)
    # The bug the weighting fixes is visible at this tolerance: means of means differ.
    assert max_diff(_reference(2, token_mean=False)[0], _reference(2)[0]) > 100 * TOL


def _pipe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A pipeline's ``loss_fn``: its micro-batch's token sum (the schedule runs it)."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def _pipe_batch(step: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences (one a micro-batch) keeping 0 to 8 tokens each."""
    g = torch.Generator().manual_seed(1000 + 10 * step + shard)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    for row in range(2):
        y[row, _kept(step, row, shard) % (SEQ + 1) :] = -100
    return x, y


def _pipeline_ranks(mesh: dict[str, int]) -> dict[str, Any]:
    from manygpu import Parallel, Pipeline

    strategy = Pipeline(loss_fn=_pipe_loss, microbatches=2)
    with Parallel(strategy=strategy, mesh=mesh, timeout_s=60) as par:
        torch.manual_seed(0)
        model = gpt_sequential()
        model, opt = par.prepare(model, _opt(model))
        shard, shards = par.strategy.data_shard()
        for step in range(STEPS):
            x, y = _pipe_batch(step, shard)
            par.backward(model(x, target=y), tokens=(y != -100).sum())
            par.clip_grad_norm_(model, CLIP)
            opt.step()
            opt.zero_grad()
        return {"params": full_params(par.unwrap(model)), "shards": shards}


def _pipe_reference(shards: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = gpt_sequential()
    opt = _opt(model)
    for step in range(STEPS):
        pieces = [_pipe_batch(step, s) for s in range(shards)]
        total = sum(int((y != -100).sum()) for _, y in pieces)
        (sum(_pipe_loss(model(x), y) for x, y in pieces) / total).backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return full_params(model)


@pytest.mark.parametrize("mesh", [{"pp": 2}, {"pp": 2, "dp": 2}], ids=["pp2", "pp2-dp2"])
def test_a_pipelines_token_sums_weigh_by_tokens_too(mesh: dict[str, int]) -> None:
    """``loss_fn`` returns each micro-batch's token sum; ``par.backward(loss, tokens=n)``
    with the batch's count undoes the schedule's 1/micro-batches: one process's mean."""
    world = 2 if len(mesh) == 1 else 4
    ranks = run_ranks(_pipeline_ranks, world, mesh, timeout=300)
    want = _pipe_reference(ranks[0]["shards"])
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:  # each stage holds some layers; its dp replicas the same ones
        merged |= rank["params"]
    diff = max_diff(merged, want)
    assert diff < TOL, f"max |param - one process| = {diff:.2e}"


def _tokens_on_rank_0_only() -> list[str]:
    from manygpu import Parallel, UsageError

    said = []
    with Parallel(strategy="ddp", timeout_s=30) as par:
        model = par.prepare(torch.nn.Linear(4, 1))
        for _ in range(2):  # the first step, then one after the job's mode is agreed
            loss = model(torch.randn(3, 4)).sum()
            try:
                par.backward(loss, tokens=3 if par.rank == 0 else None)
            except UsageError as exc:
                said.append(str(exc))
    return said


def test_tokens_on_some_ranks_only_is_one_line_on_every_rank_not_a_hang() -> None:
    for said in run_ranks(_tokens_on_rank_0_only, 2, timeout=90):
        assert len(said) == 2, said
        assert all("on some micro-steps or ranks and not others" in s for s in said), said
