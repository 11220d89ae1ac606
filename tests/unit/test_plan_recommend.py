"""recommend(): the plain strategy name and sizes that strategy='auto' will use."""

from __future__ import annotations

import pytest
from torch import nn

from manygpu.errors import UsageError
from manygpu.plan.desc import ModelDesc, transformer
from manygpu.plan.hardware import Cluster, preset
from manygpu.plan.recommend import recommend

NAMES = {"single", "ddp", "zero1", "zero2", "fsdp", "model", "pipeline", "tensor", "ps"}


def test_a_small_model_gets_ddp() -> None:
    desc = ModelDesc(name="cnn", parameters=1_000_000, step_compute_s=0.1, compute_batch=32)
    plan = recommend(desc, preset("h100"), batch=32)
    assert plan.strategy == "ddp" and plan.data_parallel == 8 and plan.efficiency > 0.95
    assert {c.strategy for c in plan.candidates} <= NAMES


def test_one_device_is_single_and_a_bare_module_works() -> None:
    model = nn.Linear(10, 10)
    plan = recommend(model, preset("a100", gpus_per_node=1), batch=8)
    assert plan.strategy == "single" and plan.world_size == 1


def test_a_model_too_big_for_ddp_is_sharded() -> None:
    # 3B parameters x 16 B = 48 GB of state: DDP does not fit 40 GB, ZeRO does.
    desc = ModelDesc(name="3b", parameters=3_000_000_000, flops_per_sample=6 * 3e9 * 1024)
    small = preset("a100", gpus_per_node=8)
    small = Cluster(**{**small.__dict__, "memory_gb": 40.0})
    plan = recommend(desc, small, batch=4)
    assert plan.strategy in {"zero1", "zero2", "fsdp"}
    ddp = next(c for c in plan.candidates if c.strategy == "ddp")
    assert not ddp.fits


def test_a_big_transformer_needs_model_parallelism() -> None:
    desc = transformer("70b", parameters=70_000_000_000, layers=80, hidden=8192, seq_len=512)
    plan = recommend(desc, preset("h100", nodes=4), batch=1, precision="bf16")
    assert plan.strategy in {"fsdp", "tensor", "pipeline"}
    assert plan.data_parallel * plan.tensor_parallel * plan.pipeline_parallel == 32


def test_nothing_fits_is_a_clear_error() -> None:
    desc = ModelDesc(name="huge", parameters=10**12)
    with pytest.raises(UsageError, match="fits no strategy"):
        recommend(desc, preset("v100"), batch=1)
