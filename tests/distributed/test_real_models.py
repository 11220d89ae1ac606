"""Every strategy on what users train equals one process on the same global batches.

Models (tests/helpers/zoo.py): a nanoGPT-layout GPT (ModuleList of blocks,
tied head, SDPA, bias-free q/k/v), Hugging Face GPT-2 (Conv1D, tied lm_head),
Llama (RMSNorm, rotary, SwiGLU, grouped kv heads) and BERT with a
classification head, from tiny local configs; a BatchNorm ResNet. Recipe
(tests/helpers/recipes.py): AdamW with decay / no-decay groups, warmup +
cosine LambdaLR, ``par.clip_grad_norm_(0.3)`` (active on most steps), 22
samples (divides by neither world size nor batch), accumulation with a short
last cycle; other torch optimizers on the GPT; bf16 autocast.

Each rank builds its model from a *different* seed: the ``initial`` check
proves ``prepare`` starts every replica (and every shard) from rank 0's weights.

Tolerance: max |param - reference| < 1e-5 in fp32 (only summation order
differs). AdamW/Adam get 1e-4: their update g / (sqrt(v) + eps) normalises
each gradient, so an entry whose gradient is ~1e-9 (an embedding row of a
token seen once) turns a last-bit difference of its gradient into a visible
change of its step; SGD-family optimizers stay under 1e-5. bf16: see BF16_TOL.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from dist_harness import preload, run_ranks
from recipes import Recipe, max_diff, reference_train, titan_fsdp, train_parallel
from zoo import lm_loss

from manygpu import Parallelize, Pipeline

pytest.importorskip("transformers")
# Importing the three models takes ~6 s of CPU: once in the rank server, not once per rank.
HF_MODULES = [f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "bert")]
preload("recipes", "zoo", *HF_MODULES)

TOL, ADAM_TOL, BF16_TOL = 1e-5, 1e-4, 5e-4
# bf16 autocast against a bf16-autocast reference: a matmul over a rank's rows
# rounds (8-bit mantissa) differently from one over the global batch; measured
# 5e-5 to 7e-5 after 3 steps, where a missing or doubled gradient sync is ~1e-2.
BF16 = [
    Recipe(m, optimizer="sgd_nesterov", precision="bf16", clip=1.0) for m in ("gpt", "hf_llama")
]
HF = [Recipe("hf_gpt2"), Recipe("hf_llama"), Recipe("hf_bert")]
GPT_ACCUM = Recipe("gpt", accum=2)  # 3 micro-batches an epoch: cycles of 2 and 1
OTHER_OPTIMIZERS = [
    Recipe("gpt", optimizer=o, clip=1.0) for o in ("adam", "sgd_nesterov", "adagrad", "rmsprop")
]
RESNET = Recipe("resnet", optimizer="sgd_nesterov", per_shard_forward=True)
PIPE = Pipeline(loss_fn=lm_loss, microbatches=2)
# Activation checkpointing under each strategy: one more run in the case's job,
# which must equal the same recipe without it in that job (see _check_checkpointing).
AC, AC_TOL = "activation_checkpointing", 1e-6
# Built empty (init_module) and loaded with weights= straight into each rank's part:
# the tied GPT and Llama must train as one process loaded from the same file.
GPT_W, LLAMA_W, SEQ_W = (Recipe(m, weights=True) for m in ("gpt", "hf_llama", "gpt_seq"))


def _ac(recipe: Recipe, mode: str) -> Recipe:
    return replace(recipe, parallel={AC: mode})


CASES: dict[str, tuple[int, dict[str, Any], list[Recipe]]] = {
    # BatchNorm under ddp: each rank normalises by its own batch (the reference's
    # per-shard forward), so the parameters match that; DDP copies rank 0's
    # buffers to every rank before each forward (eval too), so the running
    # statistics in use are rank 0's, though each rank's last forward updated its
    # own. torch.nn.SyncBatchNorm (CUDA only) normalises over the global batch.
    # Checkpointed, the resnet's BatchNorm statistics move once a step, not again in
    # the recomputation: its buffers equal the run without it (_check_checkpointing).
    "ddp": (
        2,
        {"strategy": "ddp"},
        [GPT_ACCUM, *HF, *OTHER_OPTIMIZERS, RESNET, *BF16, _ac(RESNET, "full"), GPT_W, LLAMA_W],
    ),
    "zero1": (
        2,
        {"strategy": "zero1"},
        [GPT_ACCUM, *HF, *OTHER_OPTIMIZERS, _ac(GPT_ACCUM, "full"), GPT_W],
    ),
    "fsdp": (
        2,
        {"strategy": "fsdp"},
        [
            GPT_ACCUM,
            *HF,
            *OTHER_OPTIMIZERS,
            *BF16,
            GPT_W,
            LLAMA_W,
            _ac(GPT_W, "full"),
            Recipe("gpt", empty=True),
        ],
    ),
    "zero2": (
        2,
        {"strategy": "zero2"},
        [GPT_ACCUM, Recipe("hf_llama"), _ac(GPT_ACCUM, "selective"), GPT_W],
    ),
    # GPT-2's Conv1D sharded is fsdp's; here the replicated dimension on the GPT and Llama.
    "hsdp-dp2-fsdp2": (
        4,
        {"strategy": "fsdp", "mesh": {"dp": 2, "fsdp": 2}},
        [GPT_ACCUM, GPT_W, LLAMA_W],
    ),
    "tensor-tp2": (
        2,
        {"strategy": "tensor"},
        [
            Recipe("gpt"),
            Recipe("hf_llama"),
            Recipe("hf_bert"),
            _ac(Recipe("gpt"), "selective"),
            GPT_W,
            LLAMA_W,
            Recipe("hf_llama", empty=True),
        ],
    ),
    # The Llama trains here loaded with weights= (against the same reference as built
    # and broadcast, which tensor-tp2 checks). A run on this mesh costs ~1 CPU-s a rank:
    # DTensor works out each op's sharding anew in every job (its cache goes at close).
    "hybrid-dp2-tp2": (
        4,
        {"mesh": {"dp": 2, "tp": 2}},
        [GPT_ACCUM, _ac(GPT_ACCUM, "full"), GPT_W, LLAMA_W],
    ),
    "pipeline-pp2": (
        2,
        {"strategy": PIPE},
        [Recipe("gpt_seq"), _ac(Recipe("gpt_seq"), "full"), SEQ_W, Recipe("gpt_seq", empty=True)],
    ),
    "pipeline-pp2-dp2": (
        4,
        {"strategy": PIPE, "mesh": {"pp": 2, "dp": 2}},
        [
            Recipe("gpt_seq", samples=24),
            _ac(Recipe("gpt_seq", samples=24), "selective"),
            replace(SEQ_W, samples=24),
        ],
    ),
    # Two stages per rank, weight gradients deferred into the bubble; built empty too.
    "pipeline-pp2-zero-bubble": (
        2,
        {"strategy": replace(PIPE, schedule="interleaved-zero-bubble")},
        [Recipe("gpt_seq"), Recipe("gpt_seq", empty=True)],
    ),
    "model-dp2": (2, {"strategy": "model", "mesh": {"dp": 2}}, [Recipe("gpt_seq"), SEQ_W]),
    # The user's own plan (torchtitan's FSDP2 per block) on the job's mesh.
    "parallelize-fsdp2": (2, {"strategy": Parallelize(titan_fsdp)}, [GPT_ACCUM, GPT_W]),
}

# (case, model) pairs a strategy cannot run: prepare must refuse in one line naming the fix.
REFUSED = {
    "tensor-tp2": [(Recipe("hf_gpt2"), "Conv1D")],
    "pipeline-pp2": [(Recipe("gpt"), "nn.Sequential")],
    "model-dp2": [(Recipe("gpt"), "nn.Sequential")],
}


def _merged(outs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Every rank's tensors by name (pipeline stages each hold some; replicas all)."""
    merged: dict[str, Any] = {}
    for out in outs:
        for name, tensor in out[key].items():
            if name in merged:  # a replica: must be identical to its peers
                assert (merged[name] - tensor).abs().max().item() == 0, f"replicas differ: {name}"
            merged[name] = tensor
    return merged


_REFERENCES: dict[tuple[str, int], dict[str, Any]] = {}


def _reference(recipe: Recipe, data_world: int) -> dict[str, Any]:
    """``reference_train``, computed once per recipe and data width for all cases."""
    # Parallel's keywords and the loading path leave the reference unchanged.
    key = (repr(replace(recipe, parallel={}, weights=False, five_lines=False)), data_world)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_train(recipe, data_world)
    return _REFERENCES[key]


def _check(recipe: Recipe, outs: list[dict[str, Any]]) -> None:
    errors = [o["error"] for o in outs if "error" in o]
    assert not errors, f"{recipe.model}: {errors[0]}"
    ref = _reference(recipe, outs[0]["data_world"])
    # Every replica / shard starts from rank 0's weights, though each rank built its own.
    assert max_diff(_merged(outs, "initial"), ref["initial"]) == 0, recipe
    if not recipe.per_shard_forward:
        _merged(outs, "buffers")  # replicas' buffers are identical
    tol = ADAM_TOL if recipe.optimizer.startswith("adam") else TOL
    tol = BF16_TOL if recipe.precision == "bf16" else tol
    diff = max_diff(_merged(outs, "params"), ref["params"])
    assert diff < tol, f"{recipe}: max |param - reference| = {diff:.2e}"
    if recipe.clip is not None:
        for out in outs:  # the model's norm, on every rank, whatever it holds
            rel = 1e-2 if recipe.precision == "bf16" else 1e-5
            assert out["norms"] == pytest.approx(ref["norms"], rel=rel), recipe
        clipped = sum(n > recipe.clip for n in ref["norms"])
        assert clipped >= len(ref["norms"]) / 2, f"clipping seldom active: {ref['norms']}"


def _check_checkpointing(recipes: list[Recipe], results: list[list[dict[str, Any]]]) -> None:
    """A checkpointed run equals the same recipe without it in the same job, parameters
    and buffers (BatchNorm's running statistics) (1e-6: the same ops recomputed on
    the same inputs; measured equal to the last bit),
    and its blocks did checkpoint on every rank (pipeline stages hold some each)."""
    for i, recipe in enumerate(recipes):
        if AC not in recipe.parallel:
            continue
        j = recipes.index(replace(recipe, parallel={}))
        for rank, outs in enumerate(results):
            got, want = outs[i], outs[j]
            assert got["checkpointed"] > 0 == want["checkpointed"], f"rank {rank}: {recipe}"
            assert max_diff(got["params"], want["params"]) <= AC_TOL, f"rank {rank}: {recipe}"
            if want["buffers"]:  # the GPT has none
                assert max_diff(got["buffers"], want["buffers"]) <= AC_TOL, f"rank {rank}: {recipe}"
            assert got["norms"] == pytest.approx(want["norms"], rel=AC_TOL), recipe


def _check_same(five: Recipe, outs: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """The five-line run equals the build-after run bit for bit (same ops, same order)."""
    errors = [o["error"] for o in outs if "error" in o]
    assert not errors, f"{five}: {errors[0]}"
    assert max_diff(_merged(outs, "params"), _merged(after, "params")) == 0, five
    assert [o["norms"] for o in outs] == [o["norms"] for o in after], five


@pytest.mark.parametrize("case", list(CASES))
def test_real_models_match_one_process(case: str) -> None:
    world, parallel, recipes = CASES[case]
    refused = REFUSED.get(case, [])
    # The first recipe again in the README's five lines: optimizer and scheduler built
    # on the model before prepare(model, opt, loader) must train exactly the same.
    # So must the first model loaded with weights=, its optimizer built on the empty model.
    bases = [0, *[i for i, r in enumerate(recipes) if r.weights][:1]]
    fives = [replace(recipes[i], five_lines=True) for i in bases]
    all_recipes = [*recipes, *fives, *(r for r, _ in refused)]
    results = run_ranks(train_parallel, world, all_recipes, parallel, timeout=400)
    for i, recipe in enumerate(recipes):
        _check(recipe, [r[i] for r in results])
    for k, (i, five) in enumerate(zip(bases, fives, strict=True)):
        at = len(recipes) + k
        _check_same(five, [r[at] for r in results], [r[i] for r in results])
    _check_checkpointing(recipes, results)
    for j, (_, needle) in enumerate(refused, start=len(recipes) + len(fives)):
        for rank_results in results:
            error = rank_results[j].get("error", "no error")
            assert error.startswith("UsageError") and needle in error, error
            assert "\n" not in error
