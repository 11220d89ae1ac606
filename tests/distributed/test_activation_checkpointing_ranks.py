"""Activation checkpointing on 2 real gloo ranks trains exactly as without it.

One spawned job (2 ranks, one process group that every ``Parallel`` borrows)
runs the same recipe (tests/helpers/recipes.py: AdamW with decay groups,
warmup + cosine, clipping at 0.3) with and without ``activation_checkpointing``:
the zoo's GPT under ddp ("full") and fsdp ("selective"), Hugging Face Llama
under fsdp ("selective": its rotary, grouped-kv attention and generation cache
inside a sharded unit), and the GPT once with ``compile=True`` under ddp. Two
optimizer steps of 4 samples a rank: the second step's forward and
recomputation run on updated (and, under fsdp, re-gathered) weights, and one
batch shape means one compilation. The other strategies (zero1, zero2, tensor,
pipeline, dp x tp and pp x dp meshes) are checked where their real-model recipes
already run, in test_real_models.py's jobs.

Checkpointing recomputes the same ops on the same inputs (the non-reentrant
form restores the RNG state too), so in eager fp32 the runs agree to the last
bit; the tolerance below is what is allowed:

- eager: max |param - param without checkpointing| <= 1e-6 and every step's
  gradient norm (the clipping input, all ranks' gradients) within 1e-6
  relative. A block that lost its gradient, or one recomputed on other
  inputs, moves them by ~1e-3.
- compile=True against eager without checkpointing: inductor's generated
  kernels fuse and reorder (see test_compile_channels_last.py): 1e-5.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from dist_harness import preload, run_ranks
from recipes import Recipe, max_diff, train_parallel

pytest.importorskip("transformers")
# Importing Llama takes seconds of CPU, inductor ~0.9: once in the rank server, not per rank.
preload("recipes", "zoo", "transformers.models.llama.modeling_llama", "torch._inductor.compile_fx")

pytestmark = pytest.mark.slow

WORLD, EAGER_TOL, COMPILED_TOL = 2, 1e-6, 1e-5
AC = "activation_checkpointing"
SMALL = {"samples": 16, "clip": 0.3}  # 8 samples a rank: two steps of 4
GPT, LLAMA = Recipe("gpt", **SMALL), Recipe("hf_llama", **SMALL)  # type: ignore[arg-type]
CASES = {
    "ddp": [GPT, replace(GPT, parallel={AC: "full"})],
    "fsdp": [
        GPT,
        replace(GPT, parallel={AC: "selective"}),
        LLAMA,
        replace(LLAMA, parallel={AC: "selective"}),
    ],
}
COMPILED = replace(GPT, parallel={AC: "selective", "compile": True})


def _job() -> dict[str, list[dict[str, Any]]]:
    out = {name: train_parallel(recipes, {"strategy": name}) for name, recipes in CASES.items()}
    out["compiled"] = train_parallel([COMPILED], {"strategy": "ddp"})
    return out


def _close(got: dict[str, Any], want: dict[str, Any], tol: float, what: str) -> None:
    assert "error" not in got, f"{what}: {got['error']}"
    assert "error" not in want, f"{what} (without checkpointing): {want['error']}"
    assert got["checkpointed"] > 0 == want["checkpointed"], f"{what}: checkpointing did not act"
    assert max_diff(got["params"], want["params"]) <= tol, what
    assert len(got["norms"]) == len(want["norms"]) == 2
    for a, b in zip(got["norms"], want["norms"], strict=True):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"{what}: gradient norm {a} vs {b}"


@pytest.mark.timeout(240)  # 7 two-step trainings, one compilation on the CPU among them
def test_checkpointed_training_matches_training_without_it() -> None:
    ranks = run_ranks(_job, WORLD, timeout=220.0)
    for rank, outs in enumerate(ranks):
        for strategy, recipes in CASES.items():
            runs = outs[strategy]
            plain = {r.model: runs[i] for i, r in enumerate(recipes) if not r.parallel}
            for recipe, got in zip(recipes, runs, strict=True):
                if recipe.parallel:
                    what = f"rank {rank} {strategy} {recipe.model} {recipe.parallel}"
                    _close(got, plain[recipe.model], EAGER_TOL, what)
        compiled = outs["compiled"][0]
        _close(compiled, outs["ddp"][0], COMPILED_TOL, f"rank {rank} ddp compile=True selective")
