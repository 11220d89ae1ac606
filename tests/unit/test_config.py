"""Configuration validation, batch splitting and accumulation boundaries."""

from __future__ import annotations

import pytest

from manygpu import DDP, ParallelConfig, available_strategies
from manygpu.core.accumulation import Accumulator
from manygpu.core.data import per_rank_batch
from manygpu.errors import UsageError


def test_unknown_strategy_lists_available_names() -> None:
    with pytest.raises(UsageError, match="unknown strategy 'fsdp9'") as info:
        ParallelConfig(strategy="fsdp9")
    for name in ("single", "dp", "ddp"):
        assert name in str(info.value)
    assert set(available_strategies()) >= {"single", "dp", "ddp"}


def test_unknown_precision() -> None:
    with pytest.raises(
        UsageError, match=r"precision 'fp4'; choose one of auto, fp32, fp32-strict, bf16, fp16, fp8"
    ):
        ParallelConfig(precision="fp4")  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", [0, -1, 1.5])
def test_bad_grad_accum_steps(steps: object) -> None:
    with pytest.raises(UsageError, match="grad_accum_steps must be an integer >= 1"):
        ParallelConfig(grad_accum_steps=steps)  # type: ignore[arg-type]


def test_bad_timeout() -> None:
    with pytest.raises(UsageError, match="timeout_s must be a finite number of seconds > 0"):
        ParallelConfig(timeout_s=0)


def test_strategy_defaults_from_world_size() -> None:
    config = ParallelConfig()
    assert config.resolved_strategy(1) == "single"
    assert config.resolved_strategy(4) == "ddp"
    assert ParallelConfig(strategy="dp").resolved_strategy(4) == "dp"


@pytest.mark.parametrize("cap", [0, -5.0])
def test_ddp_bucket_cap_must_be_positive(cap: float) -> None:
    with pytest.raises(UsageError, match="bucket_cap_mb must be > 0"):
        DDP(bucket_cap_mb=cap)


def test_ddp_unknown_grad_compression() -> None:
    with pytest.raises(UsageError, match="unknown grad_compression 'int8'"):
        DDP(grad_compression="int8")  # type: ignore[arg-type]


def test_global_batch_smaller_than_world() -> None:
    with pytest.raises(UsageError, match="smaller than the world size"):
        per_rank_batch(3, 4, split=True)


def test_global_batch_not_divisible() -> None:
    with pytest.raises(UsageError, match="does not divide over 4 ranks"):
        per_rank_batch(10, 4, split=True)


def test_per_rank_batch_split_and_unsplit() -> None:
    assert per_rank_batch(12, 4, split=True) == 3
    assert per_rank_batch(3, 4, split=False) == 3


def _boundaries(acc: Accumulator, n: int) -> list[bool]:
    return [acc.advance() for _ in range(n)]


def test_accumulator_every_third_step() -> None:
    acc = Accumulator(3)
    assert _boundaries(acc, 7) == [False, False, True, False, False, True, False]
    assert not acc.last_synced


def test_accumulator_next_is_boundary_known_before_backward() -> None:
    acc = Accumulator(3)
    seen = []
    for _ in range(6):
        seen.append(acc.next_is_boundary)
        acc.advance()
    assert seen == [False, False, True, False, False, True]


def test_accumulator_force_boundary_restarts_cycle() -> None:
    acc = Accumulator(3)
    assert acc.advance() is False
    acc.force_boundary()
    assert acc.next_is_boundary
    assert acc.advance() is True
    assert acc.last_synced
    # A fresh cycle of three starts after the forced boundary.
    assert _boundaries(acc, 3) == [False, False, True]


def test_accumulator_of_one_syncs_every_step() -> None:
    assert _boundaries(Accumulator(1), 3) == [True, True, True]
