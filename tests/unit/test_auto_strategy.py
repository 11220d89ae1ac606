"""``strategy="auto"``: the planner picks the simplest strategy whose memory fits."""

from __future__ import annotations

import pytest
import torch
from reference import make_model
from torch import nn

from manygpu import Parallel, UsageError
from manygpu.core import auto


def _big() -> nn.Module:
    return nn.Sequential(*(nn.Linear(1000, 1000) for _ in range(10)))  # 10M parameters


def _choose(memory_gb: float, world: int, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(auto, "device_memory_gb", lambda device, local_world: memory_gb)
    return auto.choose_strategy(
        _big(), world=world, local_world=world, device=torch.device("cpu"),
        precision="fp32", batch=1, timeout_s=10,
    )  # fmt: skip


def test_alone_it_picks_single() -> None:
    with Parallel(strategy="auto", device="cpu") as par:
        model = par.prepare(make_model())
        assert par.strategy_name == "single"
        assert par.unwrap(model) is model


def test_plenty_of_memory_means_replication(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _choose(64.0, world=2, monkeypatch=monkeypatch) == "ddp"


def test_tight_memory_means_sharding(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10M params x 16 B (fp32 + grads + Adam) = 160 MB replicated; 80 MB per rank as ZeRO-3.
    assert _choose(0.125, world=2, monkeypatch=monkeypatch) in ("zero2", "fsdp")
    assert _choose(0.125, world=4, monkeypatch=monkeypatch) in ("zero1", "zero2", "fsdp")


def test_nothing_plain_fits_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"fits no strategy|only 'pipeline'|only 'tensor'"):
        _choose(0.01, world=2, monkeypatch=monkeypatch)


def test_the_chosen_strategy_checks_the_job_not_the_provisional_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If the planner's pick cannot run this job, prepare says why in that strategy's words."""
    from manygpu.core import parallel

    def choose(model: nn.Module, **kw: object) -> str:
        return "pipeline"  # needs a loss function, which this job does not give

    monkeypatch.setattr(parallel, "choose_strategy", choose)
    with Parallel(strategy="auto", device="cpu") as par:
        with pytest.raises(UsageError, match=r"Pipeline\(loss_fn=\.\.\.\)"):
            par.prepare(make_model())
        assert par.strategy_name == "single"  # nothing was swapped in
