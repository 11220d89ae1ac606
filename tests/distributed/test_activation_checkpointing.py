"""Activation checkpointing on 2 real gloo ranks trains exactly as without it.

One spawned job (2 ranks, one process group that every ``Parallel`` borrows)
runs the same recipe (tests/helpers/recipes.py: the zoo's GPT and Hugging Face
Llama, AdamW with decay groups, warmup + cosine, clipping at 0.3
(14 samples: 7 a rank, batches of 4 and 3) with and without
``activation_checkpointing`` under ddp and fsdp, and once with
``compile=True`` under ddp. Checkpointing recomputes the same ops on the same
inputs (the non-reentrant form restores the RNG state too), so in eager fp32
the runs agree to the last bit; the tolerance below is what is allowed:

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

preload("recipes", "zoo")

pytestmark = pytest.mark.slow

WORLD, EAGER_TOL, COMPILED_TOL = 2, 1e-6, 1e-5
AC = "activation_checkpointing"
SMALL = {"samples": 14, "clip": 0.3}  # 7 samples a rank: batches of 4 and 3
GPT, LLAMA = Recipe("gpt", **SMALL), Recipe("hf_llama", **SMALL)  # type: ignore[arg-type]
CASES = {
    "ddp": [
        GPT,
        replace(GPT, parallel={AC: "full"}),
        LLAMA,
        replace(LLAMA, parallel={AC: "selective"}),
    ],
    "fsdp": [
        GPT,
        replace(GPT, parallel={AC: "selective"}),
        LLAMA,
        replace(LLAMA, parallel={AC: 2}),
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
    assert max_diff(got["params"], want["params"]) <= tol, what
    assert len(got["norms"]) == len(want["norms"]) > 0
    for a, b in zip(got["norms"], want["norms"], strict=True):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"{what}: gradient norm {a} vs {b}"


@pytest.mark.timeout(400)  # 9 short trainings, compile on the CPU among them
def test_checkpointed_training_matches_training_without_it() -> None:
    ranks = run_ranks(_job, WORLD, timeout=380.0)
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
