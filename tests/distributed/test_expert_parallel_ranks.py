"""Expert parallelism (``mesh={"ep": 2}``, ``{"dp": 2, "ep": 2}``) equals one process.

A tiny Hugging Face Mixtral (4 experts, top-2, hidden 32, 2 layers) and a
torchtitan-style grouped MoE (tests/helpers/moe_models.py) train 3 AdamW steps
with clipping (max norm 0.5, so the clip is active and the norm enters every
parameter's update) on one global batch split over the data ranks. Against one
process on the whole batch: the per-step losses and gradient norms, the first
step's gradients of every parameter (routers and experts included, before
clipping) and the parameters after the last step agree within ``TOL`` (fp32;
only summation order differs). The batch gives the experts uneven loads and at
least one expert no token on some rank and step. A run whose expert gradients
are multiplied by ``ep`` after the sync (the pytorch#160285 bug) must fail the
same comparison. With the router's load-balancing loss (Mixtral's
``output_router_logits``), manygpu's ``load_balancing_loss`` over the data ranks
equals Hugging Face's function on the global batch in one process, and each
rank's own (the mean of per-rank aux losses) must not. Each run_ranks call
serves several cases (one process start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_ranks
from moe_models import EXPERTS, TOP_K, VOCAB, grouped_model, mixtral
from torch import nn
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from manygpu import Parallel
from manygpu.strategies.expert.balance import load_balancing_loss

TOL = 1e-5
STEPS, GLOBAL, SEQ, LR, CLIP, AUX = 3, 4, 8, 1e-2, 0.5, 0.5


def make(kind: str) -> nn.Module:
    return mixtral() if kind.startswith("mixtral") else grouped_model()


def batches() -> torch.Tensor:
    """Random sequences, then a second half of one token repeated: every copy of that
    token routes alike, so the second half's ranks load two experts and leave two empty."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (STEPS, GLOBAL, SEQ), generator=gen)
    tokens[:, GLOBAL // 2 :] = torch.randint(0, VOCAB, (STEPS, 1, 1), generator=gen)
    return tokens


def loss_of(kind: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The LM loss; ``mixtral-aux`` adds the router's load-balancing loss of the global
    batch: Hugging Face's function in one process, manygpu's over the data ranks."""
    if kind == "mixtral":
        return model(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]
    if kind in ("mixtral-aux", "mixtral-local-aux"):  # local: each rank's own batch's
        out = model(input_ids=tokens, output_router_logits=True)
        whole = dist.is_initialized() and kind == "mixtral-aux"
        logits, balance = out.logits, (load_balancing_loss if whole else load_balancing_loss_func)
        aux = balance(out.router_logits, EXPERTS, TOP_K)
        return _next_token(logits, tokens) + AUX * aux  # type: ignore[no-any-return]
    return _next_token(model(tokens), tokens)


def _next_token(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    shifted = logits[:, :-1].reshape(-1, VOCAB).float()
    return F.cross_entropy(shifted, tokens[:, 1:].reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def reference(kind: str) -> dict[str, Any]:
    """One process, the global batch, the same model, optimizer and clipping."""
    model = make(kind)
    opt = _optimizer(model.parameters())
    losses, norms, grads = [], [], {}
    for step, tokens in enumerate(batches()):
        loss = loss_of(kind, model, tokens)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params}


def _loads(model: nn.Module, seen: list[list[int]]) -> None:
    """Record each experts call's rows per expert (this rank's copies)."""
    for name, module in model.named_modules():
        if name.endswith("experts"):

            def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
                if args[1].dim() == 1:
                    seen.append(args[1].tolist())
                else:  # routed: (x, top_k_index, top_k_weights)
                    seen.append(torch.bincount(args[1].reshape(-1), minlength=4).tolist())

            module.register_forward_pre_hook(hook)


def _train(kind: str, mesh: dict[str, int], scale_experts: float, accum: int = 1) -> dict[str, Any]:
    """One case on this rank; ``accum``: its batch in that many micro-batches."""
    par = Parallel(mesh=mesh, grad_accum_steps=accum)  # the mesh's ep axis picks "ep"
    try:
        model = par.prepare(make(kind))
        opt = par.prepare(_optimizer(model.parameters()))
        inner = par.unwrap(model)
        sync = par.strategy.grad_sync(inner)  # type: ignore[attr-defined]
        sync.scale_experts = scale_experts
        seen: list[list[int]] = []
        _loads(inner, seen)
        shard, shards = par.strategy.data_shard()
        per = GLOBAL // shards // accum
        losses, norms, grads = [], [], {}
        for step, tokens in enumerate(batches()):
            loss = torch.zeros(())
            for micro in range(accum):
                start = (shard * accum + micro) * per
                part = loss_of(kind, model, tokens[start : start + per])
                par.backward(part)
                loss += part.detach() / accum
            if step == 0:
                grads = {
                    n: _full(p.grad) for n, p in inner.named_parameters() if p.grad is not None
                }
            norms.append(par.clip_grad_norm_(model, CLIP).item())
            opt.step()
            opt.zero_grad()
            losses.append(par.reduce(loss).item())
        params = {n: _full(p) for n, p in inner.named_parameters()}
        local = {
            n: tuple(p.to_local().shape)
            for n, p in inner.named_parameters()
            if hasattr(p, "to_local")
        }
        return {
            "losses": losses, "norms": norms, "grads": grads, "params": params, "loads": seen,
            "strategy": par.strategy.name, "local": local,
        }  # fmt: skip
    finally:
        par.close()


def _cases(cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [_train(*case) for case in cases]


def mismatches(got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What differs from one process by more than ``TOL`` (empty: equal)."""
    wrong = [
        key
        for key in ("losses", "norms")
        if any(abs(a - b) > TOL for a, b in zip(got[key], ref[key], strict=True))
    ]
    for part in ("grads", "params"):
        assert got[part].keys() == ref[part].keys(), part
        wrong += [
            f"{part}:{name}"
            for name, value in ref[part].items()
            if (got[part][name] - value).abs().max().item() > TOL
        ]
    return wrong


def _check_loads(results: list[dict[str, Any]]) -> None:
    """Uneven loads, and some expert with no token on some rank in some call."""
    loads = [counts for out in results for counts in out["loads"]]
    assert any(0 in counts for counts in loads), loads
    assert any(max(c) > 2 * min(c) + 1 for c in loads), loads


def test_ep2_equals_one_process_and_a_gradient_scaled_by_ep_does_not() -> None:
    cases = [("grouped", {"ep": 2}, 1.0), ("mixtral", {"ep": 2}, 1.0), ("grouped", {"ep": 2}, 2.0)]
    cases += [("mixtral-aux", {"ep": 2}, 1.0), ("mixtral-local-aux", {"ep": 2}, 1.0)]
    cases.append(("mixtral", {"ep": 2}, 1.0, 2))  # accumulation: synced once per 2 backwards
    per_rank = run_ranks(_cases, 2, cases, timeout=240)
    refs = {kind: reference(kind) for kind in ("grouped", "mixtral", "mixtral-aux")}
    refs["mixtral-local-aux"] = refs["mixtral-aux"]
    for index, (kind, _, scale, *_) in enumerate(cases):
        results = [ranks[index] for ranks in per_rank]
        assert all(out["strategy"] == "ep" for out in results)
        wrong = [mismatches(out, refs[kind]) for out in results]
        if kind == "mixtral-local-aux":  # the mean of each rank's aux loss is not the batch's
            assert all("losses" in w and "grads:model.layers.0.mlp.gate.weight" in w for w in wrong)
        elif scale == 1.0:
            assert wrong == [[], []], wrong
            _check_loads(results)
        else:  # the bug is caught: expert gradients, the norm, then every parameter
            assert all("grads:layers.0.experts.w1" in w and "norms" in w for w in wrong), wrong
    # Each rank holds half of each layer's experts; routers and the rest are whole.
    local = per_rank[0][0]["local"]
    assert local["layers.0.experts.w1"][0] == 2 and "layers.0.router.weight" not in local


@pytest.mark.parametrize("world", [4])
def test_dp2_x_ep2_equals_one_process(world: int) -> None:
    cases = [("grouped", {"dp": 2, "ep": 2}, 1.0), ("mixtral", {"dp": 2, "ep": 2}, 1.0)]
    per_rank = run_ranks(_cases, world, cases, timeout=300)
    for index, (kind, _, _) in enumerate(cases):
        ref = reference(kind)
        wrong = [mismatches(ranks[index], ref) for ranks in per_rank]
        assert wrong == [[]] * world, wrong


def _job(strategy: str | None, mesh: dict[str, int] | None, directory: str, save_at: int) -> Any:
    """The grouped model trained to ``STEPS`` from a DCP checkpoint in ``directory`` when
    there is one, saving at step ``save_at``; its parameters and the step it resumed at."""
    from manygpu.checkpoint import Checkpointer

    par = Parallel(strategy=strategy, mesh=mesh)
    try:
        model = par.prepare(make("grouped"))
        opt = par.prepare(_optimizer(model.parameters()))
        ckpt = Checkpointer(par, directory, model=model, optimizer=opt, format="dcp")
        state = ckpt.resume(fresh_ok=True)
        started = state.step
        shard, shards = par.strategy.data_shard()
        per = GLOBAL // shards
        for tokens in batches()[state.step :]:
            par.backward(loss_of("grouped", model, tokens[shard * per : (shard + 1) * per]))
            par.clip_grad_norm_(model, CLIP)
            opt.step()
            opt.zero_grad()
            state.step += 1
            if state.step == save_at:
                ckpt.save(state)
        ckpt.close()
        params = {n: _full(p) for n, p in par.unwrap(model).named_parameters()}
        return {"started": started, "params": params}
    finally:
        par.close()


def _ep_checkpoints(saved_by_ep: str, saved_alone: str) -> list[Any]:
    return [_job(None, {"ep": 2}, saved_by_ep, 2), _job(None, {"ep": 2}, saved_alone, -1)]


def test_an_ep_checkpoint_resumes_without_ep_and_back(tmp_path: Path) -> None:
    """DCP stores the experts whole: 2 EP ranks save at step 2 and one process (a 1-rank
    ddp job) resumes there; one process saves at step 2 and 2 EP ranks resume there. Every
    run ends on one process's parameters after 3 steps, optimizer state included."""
    by_ep, alone = str(tmp_path / "by_ep"), str(tmp_path / "alone")
    first = _job("ddp", None, alone, 2)
    per_rank = run_ranks(_ep_checkpoints, 2, by_ep, alone, timeout=240)
    resumed = _job("ddp", None, by_ep, -1)
    ref = reference("grouped")["params"]
    runs = [first, resumed, *(r for ranks in per_rank for r in ranks)]
    assert [r["started"] for r in runs] == [0, 2, 0, 2, 0, 2]
    for run in runs:
        assert [n for n, v in ref.items() if (run["params"][n] - v).abs().max() > TOL] == []
