"""Expert parallelism (``mesh={"ep": 2}``, ``{"dp"|"fsdp": 2, "ep": 2}``) equals one process.

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

The same holds for a transformers 4.x-style Mixtral whose experts are an
``nn.ModuleList`` (``listed``: each rank keeps its expert modules, under their
one-process names) at ep=2 with the aux loss and at dp2 x ep2; its checkpoints
move between one process and ep=2 or ep=4, a weights file loads each rank's
experts only, and built empty it gets one process's ``init_module()`` values.
A grouped model whose experts take at most ``CAPACITY`` places (manygpu's
``Capacity``) drops the copies one process drops on the global batch, at ep=2
and dp2 x ep2; with each rank's own capacity (its tokens alone) it must not.
AdamW's eps is 1e-6 (see :func:`_optimizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import preload, run_ranks
from moe_models import EXPERTS, TOP_K, VOCAB, grouped_model, listed_model, mixtral
from torch import nn

from manygpu import Parallel
from manygpu.strategies.expert.balance import load_balancing_loss
from manygpu.strategies.expert.capacity import Capacity

# Hugging Face's Mixtral (~2.4 CPU-s to import): once in the rank server, not once
# per rank, and not at collection (see _hf_balance).
preload("moe_models", "transformers.models.mixtral.modeling_mixtral")

TOL = 1e-5
CAPACITY = 1.0
"""32 tokens top-2 over 4 experts: 16 places each; the repeated token's 16 copies
overflow the two experts it picks, so some copies are dropped every step."""
STEPS, GLOBAL, SEQ, LR, CLIP, AUX = 3, 4, 8, 1e-2, 0.5, 0.5


def make(kind: str) -> nn.Module:
    if kind.startswith("listed"):
        return listed_model()
    if kind.startswith("capped"):
        return grouped_model(capacity_factor=CAPACITY)
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
        logits, balance = out.logits, (load_balancing_loss if whole else _hf_balance)
        aux = balance(out.router_logits, EXPERTS, TOP_K)
        return _next_token(logits, tokens) + AUX * aux  # type: ignore[no-any-return]
    if kind.startswith("listed"):  # experts in a ModuleList; "-aux" adds the balance loss
        logits, router_logits = model(tokens)
        balance = load_balancing_loss if dist.is_initialized() else _hf_balance
        aux = balance(router_logits, EXPERTS, TOP_K) if kind == "listed-aux" else 0.0
        return _next_token(logits, tokens) + AUX * aux  # type: ignore[no-any-return]
    return _next_token(model(tokens), tokens)


def _hf_balance(router_logits: Any, experts: int, top_k: int) -> torch.Tensor:
    """Hugging Face's load-balancing loss, imported where it is first used."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(router_logits, experts, top_k)  # type: ignore[no-any-return]


def _next_token(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    shifted = logits[:, :-1].reshape(-1, VOCAB).float()
    return F.cross_entropy(shifted, tokens[:, 1:].reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # Adam moves a parameter by up to lr/eps per unit of gradient near 0: at the default
    # eps (1e-8) a last-bit gradient difference (1e-9, summation order) of an expert that
    # saw one token moved its weights 2e-5 in 3 steps; at 1e-6 by under 1e-6.
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-6)


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
        if name.endswith("experts") and isinstance(module, nn.ModuleList):  # its router's picks
            gate = model.get_submodule(name.rpartition(".")[0]).gate

            def picks(_: nn.Module, args: Any, out: torch.Tensor) -> None:
                top = torch.topk(out, TOP_K, dim=-1).indices.reshape(-1)
                seen.append(torch.bincount(top, minlength=EXPERTS).tolist())

            gate.register_forward_hook(picks)
        elif name.endswith("experts"):

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
        if kind == "capped-local":  # each rank's capacity from its own tokens: must differ
            for module in inner.modules():
                if isinstance(module, Capacity):
                    module.group = None
        sync = par.strategy.grad_sync(inner)  # type: ignore[attr-defined]
        if sync is not None:
            sync.scale_experts = scale_experts
        else:  # under fsdp, FSDP2 reduces: the bug is dividing by fsdp's size instead
            _scale_fsdp_experts(inner, scale_experts, par.strategy.data_shard()[1])
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


def _scale_fsdp_experts(model: nn.Module, scale: float, data_ranks: int) -> None:
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if name.endswith("experts") and isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(data_ranks / scale)


def mismatches(got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What differs from one process by more than ``TOL`` (empty: equal). A rank holding
    experts one module each has only its own: :func:`check_cover` checks the rest."""
    wrong = [
        key
        for key in ("losses", "norms")
        if any(abs(a - b) > TOL for a, b in zip(got[key], ref[key], strict=True))
    ]
    for part in ("grads", "params"):
        assert got[part].keys() <= ref[part].keys(), part
        wrong += [
            f"{part}:{name}"
            for name, value in got[part].items()
            if (value - ref[part][name]).abs().max().item() > TOL
        ]
    return wrong


def check_cover(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """The ranks together hold every parameter and gradient one process has, no more."""
    for part in ("grads", "params"):
        assert set().union(*(out[part] for out in results)) == ref[part].keys(), part


def check_params_cover(runs: list[dict[str, Any]], ref: dict[str, torch.Tensor]) -> None:
    """:func:`check_cover` of the parameters alone."""
    check_cover([{"grads": {}, "params": r["params"]} for r in runs], {"grads": {}, "params": ref})


def _check_loads(results: list[dict[str, Any]]) -> None:
    """Uneven loads, and some expert with no token on some rank in some call."""
    loads = [counts for out in results for counts in out["loads"]]
    assert any(0 in counts for counts in loads), loads
    assert any(max(c) > 2 * min(c) + 1 for c in loads), loads


def test_ep2_equals_one_process_and_a_gradient_scaled_by_ep_does_not(tmp_path: Path) -> None:
    """Also: a Hugging Face Mixtral file loads with ``weights=`` into a model built
    empty, each rank reading its experts only (:func:`check_weights`)."""
    cases = [("grouped", {"ep": 2}, 1.0), ("mixtral", {"ep": 2}, 1.0), ("grouped", {"ep": 2}, 2.0)]
    cases += [("mixtral-aux", {"ep": 2}, 1.0), ("mixtral-local-aux", {"ep": 2}, 1.0)]
    cases.append(("mixtral", {"ep": 2}, 1.0, 2))  # accumulation: synced once per 2 backwards
    cases += [("listed-aux", {"ep": 2}, 1.0), ("listed", {"ep": 2}, 2.0)]  # ModuleList experts
    cases += [("capped", {"ep": 2}, 1.0), ("capped-local", {"ep": 2}, 1.0)]  # dropped copies
    saved = mixtral(seed=11)
    saved.save_pretrained(tmp_path / "hf")
    loads = [("weights", {"ep": 2}, str(tmp_path / "hf")), ("weights", {"ep": 2}, None)]
    alone, ep2 = str(tmp_path / "alone"), str(tmp_path / "ep2")
    first = _job("ddp", None, alone, 2, "listed")
    jobs = [
        ("job", None, {"ep": 2}, alone, -1, "listed"),
        ("job", None, {"ep": 2}, ep2, 2, "listed"),
    ]
    jobs.append(("weights", {"ep": 2}, None, "listed"))
    listed_file = _save_listed(tmp_path / "listed.safetensors")
    loads.append(("weights", {"ep": 2}, str(tmp_path / "listed.safetensors"), "listed"))
    calls = [("train", *c) for c in cases] + loads + jobs
    per_rank = run_ranks(_run, 2, calls, timeout=240)
    at = len(cases)
    check_weights([out for ranks in per_rank for out in ranks[at : at + 2]], saved, ep=2)
    check_listed_file([ranks[at + 2] for ranks in per_rank], listed_file)
    check_listed_resume([first, _job("ddp", None, ep2, -1, "listed")], per_rank)
    refs = {kind: reference(kind) for kind in ("grouped", "mixtral", "mixtral-aux", "listed-aux")}
    refs["mixtral-local-aux"], refs["listed"] = refs["mixtral-aux"], reference("listed")
    refs["capped"] = refs["capped-local"] = reference("capped")
    assert dropped_in_one_process() > 0
    for index, (kind, _, scale, *_) in enumerate(cases):
        results = [ranks[index] for ranks in per_rank]
        assert all(out["strategy"] == "ep" for out in results)
        wrong = [mismatches(out, refs[kind]) for out in results]
        if kind == "mixtral-local-aux":  # the mean of each rank's aux loss is not the batch's
            assert all("losses" in w and "grads:model.layers.0.mlp.gate.weight" in w for w in wrong)
        elif kind == "capped-local":  # each rank's own capacity and order drop other copies
            assert all("losses" in w and "grads:layers.0.router.weight" in w for w in wrong)
        elif scale == 1.0:
            assert wrong == [[], []], wrong
            check_cover(results, refs[kind])
            _check_loads(results)
        else:  # the bug is caught: expert gradients, the norm, then every parameter
            assert all(_expert_grad_wrong(w) and "norms" in w for w in wrong), wrong
    # Each rank holds half of each layer's experts; routers and the rest are whole.
    local = per_rank[0][0]["local"]
    assert local["layers.0.experts.w1"][0] == 2 and "layers.0.router.weight" not in local


def _save_listed(path: Path) -> dict[str, torch.Tensor]:
    """A ModuleList-experts model's weights file (its own names, each expert apart)."""
    from safetensors.torch import save_file

    state = {n: p.detach().clone() for n, p in listed_model(seed=11).named_parameters()}
    save_file(state, str(path))
    return state


def check_listed_file(results: list[dict[str, Any]], want: dict[str, torch.Tensor]) -> None:
    """Each ep rank loads its own experts (and the rest) from the file, exactly, and
    reads no other rank's expert."""
    check_params_cover(results, want)
    for out in results:
        assert [n for n, v in out["params"].items() if not torch.equal(v, want[n])] == []
        assert out["read"] == sum(v.numel() * 4 for v in out["params"].values())
    experts = [n for n in want if ".experts." in n]
    assert all(sum(n in out["params"] for n in experts) == len(experts) // 2 for out in results)


def dropped_in_one_process() -> int:
    """Routed copies the capped model drops on the first global batch, in one process."""
    model, dropped = make("capped"), []
    for module in model.modules():
        if isinstance(module, Capacity):
            module.register_forward_hook(lambda m, a, keep: dropped.append(int((~keep).sum())))
    model(batches()[0])
    return sum(dropped)


def check_listed_at_ep4(
    first: dict[str, Any], at_ep4: list[dict[str, Any]], ref: dict[str, Any]
) -> None:
    """A one-process save of ModuleList experts resumed at ep=4 (one expert module per
    rank): one process's parameters at the end, its AdamW state at the resume."""
    params, adam = ref["params"], reference_adam_at(2, "listed")
    check_params_cover(at_ep4, params)
    for run in [first, *at_ep4]:
        assert [n for n, v in run["params"].items() if (v - params[n]).abs().max() > TOL] == []
    for run in at_ep4:
        assert run["started"] == 2 and run["adam"].keys() <= adam.keys()
        assert [k for k, v in run["adam"].items() if (v - adam[k]).abs().max() > TOL] == []


def _expert_grad_wrong(wrong: list[str]) -> bool:
    return any(w.startswith("grads:layers.0.experts.") for w in wrong)


def check_listed_resume(alone: list[dict[str, Any]], per_rank: list[list[Any]]) -> None:
    """ModuleList experts' checkpoints move between one process and ep=2: a one-process
    save resumed at ep=2, an ep=2 save resumed in one process (``alone``: the first
    save and the resume), each rank's experts by their one-process names. All end on one
    process's parameters; each resume starts from its AdamW state after 2 steps."""
    ref, adam = reference("listed")["params"], reference_adam_at(2, "listed")
    at_ep2 = [r for ranks in per_rank for r in ranks[-3:-1]]
    assert [r["started"] for r in alone + at_ep2] == [0, 2, 2, 0, 2, 0]
    for found in (alone, at_ep2[0::2], at_ep2[1::2]):
        check_params_cover(found, ref)
    for run in alone + at_ep2:
        assert [n for n, v in run["params"].items() if (v - ref[n]).abs().max() > TOL] == []
        if run["started"]:
            assert run["adam"] and run["adam"].keys() <= adam.keys()
            assert [k for k, v in run["adam"].items() if (v - adam[k]).abs().max() > TOL] == []
    empty, init = [ranks[-1] for ranks in per_rank], reference_empty_init("listed")
    check_params_cover(empty, init)
    for out in empty:  # built empty: each rank's experts are one process's, exactly
        assert [n for n, v in out["params"].items() if not torch.equal(v, init[n])] == []


def _job(
    strategy: str | None,
    mesh: dict[str, int] | None,
    directory: str,
    save_at: int,
    kind: str = "grouped",
) -> Any:
    """The ``kind`` model (grouped unless told) trained to ``STEPS`` from a DCP
    checkpoint in ``directory`` when there is one, saving at step ``save_at``; its
    parameters at the end, the step it resumed at and the optimizer's state just after
    the resume (by parameter name)."""
    from manygpu.checkpoint import Checkpointer

    par = Parallel(strategy=strategy, mesh=mesh)
    try:
        model = par.prepare(make(kind))
        opt = par.prepare(_optimizer(model.parameters()))
        ckpt = Checkpointer(par, directory, model=model, optimizer=opt, format="dcp")
        state = ckpt.resume(fresh_ok=True)
        started, resumed = state.step, _adam_state(par.unwrap(model), opt)
        shard, shards = par.strategy.data_shard()
        per = GLOBAL // shards
        for tokens in batches()[state.step :]:
            par.backward(loss_of(kind, model, tokens[shard * per : (shard + 1) * per]))
            par.clip_grad_norm_(model, CLIP)
            opt.step()
            opt.zero_grad()
            state.step += 1
            if state.step == save_at:
                ckpt.save(state)
        ckpt.close()
        params = {n: _full(p) for n, p in par.unwrap(model).named_parameters()}
        return {"started": started, "params": params, "adam": resumed}
    finally:
        par.close()


def _adam_state(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """AdamW's moments and step count per parameter name, whole tensors."""
    inner = getattr(opt, "optimizer", opt)
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        for key, value in inner.state.get(p, {}).items():
            state[f"{name}.{key}"] = _full(value)
    return state


def reference_adam_at(step: int, kind: str = "grouped") -> dict[str, torch.Tensor]:
    """One process's AdamW state after ``step`` steps of the ``kind`` model (clipped)."""
    model = make(kind)
    opt = _optimizer(model.parameters())
    for tokens in batches()[:step]:
        loss_of(kind, model, tokens).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return _adam_state(model, opt)


def _weights(mesh: dict[str, int], directory: str | None, kind: str = "mixtral") -> dict[str, Any]:
    """A Mixtral built empty (``par.init_module()``) under EP, its values from the
    Hugging Face file in ``directory`` (per-expert tensors) or, with none, from
    manygpu's seeded init; the whole parameters, and the bytes a second load reads."""
    from manygpu.weights import load_weights

    par = Parallel(mesh=mesh)
    try:
        with par.init_module():
            model = make(kind)
        inner = par.unwrap(par.prepare(model, weights=directory))
        read = load_weights(inner, directory).bytes_read if directory else 0
        params = {n: _full(p) for n, p in inner.named_parameters()}
        return {"params": params, "read": read, "strategy": par.strategy.name}
    finally:
        par.close()


def reference_empty_init(kind: str = "mixtral") -> dict[str, torch.Tensor]:
    """One process's model built under ``init_module()``: manygpu's seeded values."""
    par = Parallel()
    try:
        with par.init_module():
            model = make(kind)
        model = par.unwrap(par.prepare(model))
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        par.close()


def check_weights(results: list[dict[str, Any]], saved: nn.Module, ep: int) -> None:
    """Each rank's model is the file's values (or one process's init, exactly), and a
    load reads the replicated tensors whole but only ``1/ep`` of the experts."""
    loaded, empty = results[0::2], results[1::2]
    want, init = dict(saved.named_parameters()), reference_empty_init()
    for out in loaded:
        assert out["strategy"] == "ep"
        assert [n for n, v in want.items() if not torch.equal(out["params"][n], v)] == []
        experts = sum(v.numel() * 4 for n, v in want.items() if ".experts." in n)
        if ep:  # 0: under fsdp, where a strided shard is read whole and cut
            assert (
                out["read"] == sum(v.numel() * 4 for v in want.values()) - experts + experts // ep
            )
    for out in empty:
        assert [n for n, v in init.items() if not torch.equal(out["params"][n], v)] == []


def _refused(kind: str, mesh: dict[str, int]) -> str:
    """The one-line refusal ``prepare`` gives the ``kind`` model on ``mesh``."""
    from manygpu import UsageError

    par = Parallel(mesh=mesh)
    try:
        par.prepare(make(kind))
    except UsageError as exc:
        return str(exc)
    finally:
        par.close()
    return "prepared"


def _run(calls: list[tuple[Any, ...]]) -> list[Any]:
    """Several cases on this rank in one process start: ``train``, ``job`` or ``weights``."""
    run = {"train": _train, "job": _job, "weights": _weights, "refused": _refused}
    return [run[what](*args) for what, *args in calls]


def test_at_4_ranks_dp_or_fsdp_x_ep_equals_one_process_and_checkpoints_resume_across_ep(
    tmp_path: Path,
) -> None:
    """dp=2 x ep=2 and fsdp=2 x ep=2 train as one process (and fsdp x ep with FSDP2's own
    divide factor on the experts does not); DCP stores the experts whole, so a checkpoint
    resumes on any ep size and on a job without EP: one process (a 1-rank ddp job), 2 EP
    ranks, dp2 x ep2, fsdp2 x ep2 and 4 EP ranks (4 experts: one per rank) each save at
    step 2, and jobs of another kind resume there (1 -> 2, 1 -> 4, 1 -> fsdp2xep2, 2 -> 1,
    dp2xep2 -> ep4, ep4 -> ep2, fsdp2xep2 -> ep2). A Hugging Face Mixtral file loads with
    ``weights=`` at ep=4 and at fsdp2 x ep2 (:func:`check_weights`).
    Every run ends on one process's parameters after 3 steps (within ``TOL``), and the
    AdamW state just after each resume is one process's after 2 steps. ModuleList experts
    train at dp2 x ep2, resume a one-process save at ep=4, and are refused under fsdp
    in one line; capacity drops equal one process's at dp2 x ep2."""
    d = {k: str(tmp_path / k) for k in ("alone", "ep2", "dp2ep2", "ep4", "fsdp2ep2", "hf")}
    first = _job("ddp", None, d["alone"], 2)
    saved = mixtral(seed=11)
    saved.save_pretrained(d["hf"])
    fsdp = {"fsdp": 2, "ep": 2}
    trained: list[tuple[Any, ...]] = [
        (kind, mesh, 1.0) for mesh in ({"dp": 2, "ep": 2}, fsdp) for kind in ("grouped", "mixtral")
    ]
    # FSDP2's own divide factor (fsdp's size) on the experts: their gradients ep times
    # too big (pytorch#160285), which must fail.
    trained.append(("grouped", fsdp, 2.0))
    trained.append(("listed", {"dp": 2, "ep": 2}, 1.0))  # ModuleList experts, dp x ep
    trained.append(("capped", {"dp": 2, "ep": 2}, 1.0))  # copies dropped over 4 data ranks
    listed_alone = str(tmp_path / "listed")
    first_listed = _job("ddp", None, listed_alone, 2, "listed")
    four: list[tuple[Any, ...]] = [("train", *case) for case in trained]
    four += [
        ("job", None, {"dp": 2, "ep": 2}, d["dp2ep2"], 2),
        ("job", None, {"ep": 4}, d["dp2ep2"], -1),
        ("job", None, {"ep": 4}, d["ep4"], 2),
        ("job", None, {"ep": 4}, d["alone"], -1),
        ("job", None, {"fsdp": 2, "ep": 2}, d["fsdp2ep2"], 2),
        ("job", None, {"fsdp": 2, "ep": 2}, d["alone"], -1),
        ("weights", {"ep": 4}, d["hf"]),
        ("weights", {"ep": 4}, None),
        ("weights", {"fsdp": 2, "ep": 2}, d["hf"]),
        ("weights", {"fsdp": 2, "ep": 2}, None),
        ("refused", "listed", {"fsdp": 2, "ep": 2}),
        ("job", None, {"ep": 4}, listed_alone, -1, "listed"),  # one expert module per rank
    ]
    per_four = run_ranks(_run, 4, four, timeout=300)
    check_weights([out for ranks in per_four for out in ranks[-6:-4]], saved, ep=4)
    check_weights([out for ranks in per_four for out in ranks[-4:-2]], saved, ep=0)
    refusals = {ranks[-2] for ranks in per_four}  # ModuleList experts under fsdp: one line
    assert len(refusals) == 1 and "not sharded over fsdp too" in refusals.pop()
    two = [("job", None, {"ep": 2}, d["ep2"], 2), ("job", None, {"ep": 2}, d["alone"], -1)]
    two += [("job", None, {"ep": 2}, d["ep4"], -1), ("job", None, {"ep": 2}, d["fsdp2ep2"], -1)]
    per_two = run_ranks(_run, 2, two, timeout=240)
    resumed = _job("ddp", None, d["ep2"], -1)
    refs = {kind: reference(kind) for kind in ("grouped", "mixtral", "listed", "capped")}
    for index, (kind, mesh, scale, *_) in enumerate(trained):
        wrong = [mismatches(ranks[index], refs[kind]) for ranks in per_four]
        if scale == 1.0:
            assert wrong == [[]] * 4, (mesh, wrong)
            check_cover([ranks[index] for ranks in per_four], refs[kind])
        else:
            assert all(_expert_grad_wrong(w) and "norms" in w for w in wrong), wrong
    ref, adam = reference("grouped")["params"], reference_adam_at(2)
    assert len(adam) == 3 * len(ref)  # step, exp_avg, exp_avg_sq of every parameter
    runs = [first, resumed] + [r for ranks in per_four for r in ranks[len(trained) : -6]]
    runs += [r for ranks in per_two for r in ranks]
    assert [r["started"] for r in runs] == [0, 2] + [0, 2, 0, 2, 0, 2] * 4 + [0, 2, 2, 2] * 2
    for run in runs:
        assert [n for n, v in ref.items() if (run["params"][n] - v).abs().max() > TOL] == []
        if run["started"]:
            assert run["adam"].keys() == adam.keys()
            assert [k for k, v in adam.items() if (run["adam"][k] - v).abs().max() > TOL] == []
    check_listed_at_ep4(first_listed, [ranks[-1] for ranks in per_four], refs["listed"])
