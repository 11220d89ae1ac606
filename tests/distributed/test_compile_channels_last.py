"""channels_last and compile=True on 2 real gloo ranks train as one plain-torch process does.

The recipe is what users run (tests/helpers/zoo.py): the nanoGPT-layout GPT
(ModuleList of blocks, tied head) for compile=True, the BatchNorm ResNet for
channels_last; AdamW with decay / no-decay groups, warmup + cosine
``LambdaLR``, ``par.clip_grad_norm_(0.3)`` (active on most steps); 29 samples,
which divide neither by the 2 ranks (the sampler pads to 30) nor by the batch
of 4 (the last batch has 3, so compile meets a second batch size, as it does
at the end of a real epoch). The reference is the same recipe in one process,
plain torch, eager, default memory layout, on the same global batches
(recipes.global_batches: what the prepared loader's DistributedSampler cuts).
Each test also checks the feature acted (batches and weights channels_last,
graphs compiled where the strategy compiles), so a feature that silently did
nothing fails.

Tolerances (fp32, CPU), per step and at the end:
- losses: |loss - reference| < 1e-5 (relative): only summation order differs;
  a missing gradient sync or a dropped scheduler step moves them by ~1e-3.
- parameters: max |param - reference| < 1e-4. AdamW's g / (sqrt(v) + eps)
  normalises each gradient, so an entry whose gradient is ~1e-9 (an embedding
  row of a token seen once) turns a last-bit difference into a visible change
  of its step (tests/distributed/test_real_models.py measures the same); the
  feature adds its own reordering on top: channels_last runs oneDNN's NHWC
  convolution kernels (another summation order), compile=True runs inductor's
  generated C++ kernels, which fuse element-wise ops and reorder reductions.
  Measured under 1e-6 for both; a wrong gradient moves parameters by ~1e-3.
- gradient norms (the clipping input): 1e-5 relative.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from typing import Any

import pytest
import torch
from dist_harness import preload, run_ranks
from recipes import INIT_SEED, Recipe, full_params, global_batches, max_diff, weights_file
from torch.utils.data import DataLoader
from zoo import OPTIMIZERS, ZOO, dataset, warmup_cosine

# Inductor (~0.9 CPU-s of imports) once in the rank server, not in every compiling rank.
preload("recipes", "zoo", "torch._inductor.compile_fx")

pytestmark = pytest.mark.slow

WORLD, CLIP = 2, 0.3
LOSS_TOL, PARAM_TOL, NORM_TOL = 1e-5, 1e-4, 1e-5
GPT = Recipe("gpt", samples=29, clip=CLIP)
# BatchNorm: under ddp and fsdp each rank normalises by its own batch.
RESNET = Recipe("resnet", samples=29, clip=CLIP, per_shard_forward=True)
HAS_CXX = any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
needs_cxx = pytest.mark.skipif(
    not HAS_CXX, reason="torch's CPU inductor needs a C++ compiler (g++/clang++); none found"
)


def _spy_ddp_optimizer() -> list[int]:
    """The bucket size of every graph torch's DDPOptimizer splits (it runs only under DDP)."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    calls: list[int] = []
    compile_fn = DDPOptimizer.compile_fn

    def spy(self: Any, gm: Any, example_inputs: Any) -> Any:
        calls.append(self.bucket_bytes_cap)
        return compile_fn(self, gm, example_inputs)

    DDPOptimizer.compile_fn = spy  # type: ignore[method-assign]
    return calls


def _evidence(wrapped: torch.nn.Module, inner: torch.nn.Module) -> dict[str, Any]:
    """What the feature did to the model: NHWC weights, compiled modules."""
    from torch._dynamo.utils import counters

    weights = [p for p in inner.parameters() if p.dim() == 4]
    wrapper = [] if wrapped is inner else [("wrapper", wrapped)]
    modules = [*wrapper, *((n or "model", m) for n, m in inner.named_modules())]
    return {
        "weights_channels_last": bool(weights)
        and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights),
        "compiled": sorted(
            {n for n, m in modules if getattr(m, "_compiled_call_impl", None) is not None}
        ),
        "graphs": counters["stats"]["unique_graphs"],
    }


def train_rank(runs: list[tuple[Recipe, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each recipe under its ``Parallel(**parallel)`` on this rank, one after the other in
    one process (one start, and inductor's caches shared): losses, norms, params, evidence.

    The process group is made once and every ``Parallel`` borrows it (re-creating groups
    on one port back to back races the rendezvous); dynamo is reset between runs, so each
    compiles its own model and counts its own graphs.
    """
    import datetime

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ddp_splits = _spy_ddp_optimizer()
    results = []
    for recipe, parallel in runs:
        torch._dynamo.reset()
        counters.clear()
        ddp_splits.clear()
        results.append(_train_one(recipe, parallel) | {"ddp_splits": list(ddp_splits)})
    return results


def _train_one(recipe: Recipe, parallel: dict[str, Any]) -> dict[str, Any]:
    """The recipe under ``Parallel(**parallel)`` on this rank."""
    from manygpu import Parallel

    entry = ZOO[recipe.model]
    with Parallel(precision="fp32", **parallel) as par:
        torch.manual_seed(INIT_SEED + par.rank)  # replicas start different: prepare must fix it
        if recipe.weights:  # built empty, read from the reference's start, then compiled
            path = weights_file(recipe, par.rank)
            with par.init_module():
                model = par.prepare(entry.build(), weights=path)
        else:
            model = par.prepare(entry.build())
        opt = par.prepare(OPTIMIZERS[recipe.optimizer](model))
        loader = par.prepare(DataLoader(dataset(recipe.model, recipe.samples), batch_size=4))
        sched = warmup_cosine(opt, len(loader))
        losses, norms, layouts = [], [], []
        for x, y in loader:
            layouts.append(x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
            loss = entry.loss(model(x), y)
            par.backward(loss)
            norms.append(float(par.clip_grad_norm_(model, CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
            # Each rank's mean over its batch; every rank's batch has the same size here.
            losses.append(par.reduce(loss.detach()).item())
        inner = par.unwrap(model)
        return {
            "losses": losses,
            "norms": norms,
            "params": full_params(inner),
            "batches_channels_last": all(layouts),
            **_evidence(model, inner),
        }


def reference(recipe: Recipe) -> dict[str, Any]:
    """The recipe in one process, plain eager torch, on the same global batches."""
    entry = ZOO[recipe.model]
    torch.manual_seed(INIT_SEED)  # rank 0's model: the one prepare broadcasts
    model = entry.build()
    opt = OPTIMIZERS[recipe.optimizer](model)
    batches = global_batches(recipe, WORLD)
    sched = warmup_cosine(opt, len(batches))
    losses, norms = [], []
    for parts in batches:
        xs, ys = parts[:WORLD], parts[WORLD:]
        if recipe.per_shard_forward:  # BatchNorm: each rank's batch normalised alone
            per_rank = [entry.loss(model(x), y) for x, y in zip(xs, ys, strict=True)]
            loss = torch.stack(per_rank).mean()
        else:
            loss = entry.loss(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": full_params(model)}


def _matches_reference(outs: list[dict[str, Any]], recipe: Recipe) -> None:
    ref = reference(recipe)
    assert len(ref["losses"]) == 4 and ref["losses"][0] != pytest.approx(ref["losses"][-1])
    assert sum(n > CLIP for n in ref["norms"]) >= 2, f"clipping seldom active: {ref['norms']}"
    for out in outs:
        assert out["losses"] == pytest.approx(ref["losses"], rel=LOSS_TOL)
        assert out["norms"] == pytest.approx(ref["norms"], rel=NORM_TOL)
        diff = max_diff(out["params"], ref["params"])
        assert diff < PARAM_TOL, f"max |param - reference| = {diff:.2e}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_channels_last_matches_one_plain_process(strategy: str) -> None:
    parallel = {"strategy": strategy, "channels_last": True}
    outs = [r[0] for r in run_ranks(train_rank, WORLD, [(RESNET, parallel)], timeout=240)]
    _matches_reference(outs, RESNET)
    for out in outs:
        assert out["batches_channels_last"]
        # DDP keeps whole weights: stored NHWC. FSDP2 shards only contiguous
        # parameters: its weights stay, the channels_last inputs carry the layout.
        assert out["weights_channels_last"] is (strategy == "ddp")
        assert out["compiled"] == [] and out["graphs"] == 0


@needs_cxx
@pytest.mark.timeout(480)  # four compiling runs (two strategies) on the CPU
def test_compile_matches_one_plain_process() -> None:
    """``compile=True``, then ``fullgraph=True`` (neither DDP's forward nor FSDP2's hooks
    may break a graph), under ddp then fsdp, on the same 2 ranks one after the other
    (each process sets inductor up once: its C++ compiler checks, its caches)."""
    from manygpu import CompileOptions

    runs = []
    for strategy in ("ddp", "fsdp"):
        # fsdp fullgraph: the model built empty (init_module) and loaded with weights=.
        full = replace(GPT, weights=True) if strategy == "fsdp" else GPT
        runs += [
            (GPT, {"strategy": strategy, "compile": True}),
            (full, {"strategy": strategy, "compile": CompileOptions(fullgraph=True)}),
        ]
    results = run_ranks(train_rank, WORLD, runs, timeout=480)
    for i, (recipe, parallel) in enumerate(runs):
        outs = [r[i] for r in results]
        _matches_reference(outs, recipe)
        for out in outs:
            assert out["graphs"] > 0 and not out["batches_channels_last"], parallel
            if parallel["strategy"] == "ddp":
                # Inside the DDP wrapper, after wrapping: DDPOptimizer splits the graph
                # at DDP's 25 MB gradient buckets, so all-reduces overlap the backward.
                assert out["compiled"] == ["model"], parallel
                assert out["ddp_splits"] and set(out["ddp_splits"]) == {25 * 1024 * 1024}
            else:  # each FSDP2 block, then the root
                assert out["compiled"] == ["blocks.0", "blocks.1", "model"], parallel
                assert out["ddp_splits"] == [], parallel
