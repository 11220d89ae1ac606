"""``precision="fp8"`` under FSDP2 and DDP on 2 gloo ranks equals one process (emulated).

Under FSDP2 the ranks all-gather their weights in float8 and precompute the
weights' scales after each step in one all-reduce
(:mod:`manygpu.strategies.fsdp.fp8`); under DDP each holds the whole float8
layers. One spawned job runs both, one after the other; the reference is the
same fp8 training in this process with strategy ``"single"``, on the same
global batches.

Tolerance: each step's loss within 0.5% (relative) and every parameter within
2e-2 of the reference. The weights' scales are the same (the all-reduced amax
of the whole weight), but each rank scales its activations and gradients by
the amax of its own half of the batch, so float8 rounds them differently from
one process. Measured (fsdp) after 4 SGD steps: losses within 0.2%, parameters within
5.5e-3, as far as fp8 is from bf16 in one process (5.3e-3; bf16 at 2 ranks is
5e-4 from one process). A rank training on its half alone (no gradient sync)
is 0.13 away, its losses 3%.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import preload, run_ranks
from fp8_job import train_gpt, train_gpt_strategies

preload("fp8_job", "zoo")

LOSS_REL, PARAM_TOL = 5e-3, 2e-2


def test_fsdp_and_ddp_at_two_ranks_equal_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MANYGPU_FP8_EMULATE", "1")
    jobs = run_ranks(train_gpt_strategies, 2, ["fsdp", "ddp", "fsdp+weights"], timeout=300)
    ref = train_gpt("single", "fp8")
    ranks = [job[name] for job in jobs for name in ("fsdp", "ddp")]
    for out in ranks:
        assert out["layers"]["blocks.1.fc1"] == "Float8Linear"
        assert out["losses"] == pytest.approx(ref["losses"], rel=LOSS_REL)
        diff = max((out["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
        assert diff < PARAM_TOL, f"max |param - one process| = {diff:.2e}"
    assert ranks[0]["params"].keys() == ref["params"].keys()
    # Built empty, converted to fp8 and sharded on the meta device, then read from the
    # file of rank 0's model: the same training as fsdp from rank 0's broadcast, exactly.
    for job in jobs:
        empty, built = job["fsdp+weights"], job["fsdp"]
        assert empty["layers"]["blocks.1.fc1"] == "Float8Linear"
        assert empty["losses"] == built["losses"]
        assert all(torch.equal(empty["params"][k], built["params"][k]) for k in built["params"])
