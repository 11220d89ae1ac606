"""The planner knows expert parallelism: memory of expert shards, all-to-all volume, a pick.

Pure arithmetic on model descriptions (no processes): a Mixtral-like MoE
(12.9B parameters, 12B of them in 8 experts per layer, top-2) and an
OLMoE-like one (64 experts, top-8), against a dense model of the same size.
"""

from __future__ import annotations

import pytest

from manygpu import UsageError
from manygpu.plan import hardware, memory, perf
from manygpu.plan.desc import ModelDesc, transformer
from manygpu.plan.recommend import recommend

MIXTRAL = transformer(
    "mixtral-like", parameters=12_900_000_000, layers=32, hidden=2048, seq_len=2048,
    vocab=32000, expert_parameters=12_000_000_000, num_experts=8, experts_per_token=2,
)  # fmt: skip
DENSE = transformer("dense", parameters=12_900_000_000, layers=32, hidden=2048, seq_len=2048,
                    vocab=32000)  # fmt: skip


def test_expert_parameters_divide_by_ep_and_the_rest_stays_whole() -> None:
    ep = memory.estimate(MIXTRAL, "ep", world=8, batch=2, stages=8, optimizer="adam")
    ddp = memory.estimate(MIXTRAL, "ddp", world=8, batch=2, optimizer="adam")
    dense, experts = 900_000_000, 12_000_000_000
    assert ep.params == pytest.approx((dense + experts / 8) * 4)
    assert ep.grads == pytest.approx((dense + experts / 8) * 4)
    assert ep.optimizer == pytest.approx((dense + experts / 8) * 8)
    assert ddp.params == pytest.approx((dense + experts) * 4)
    assert ep.activations == ddp.activations  # each device trains its own batch
    # Under 16-bit autocast only this device's experts are cast and kept for the backward.
    low = memory.estimate(MIXTRAL, "ep", world=8, batch=2, stages=8, precision="bf16")
    assert low.gathered == pytest.approx((dense + experts / 8) * 2)


def test_an_ep_step_has_the_token_all_to_alls_and_reduces_expert_grads_over_replicas() -> None:
    cluster = hardware.preset("h100", nodes=2, gpus_per_node=8)
    step = perf.estimate(MIXTRAL, cluster, "ep", batch=2, precision="bf16", stages=8)
    # 4 all-to-alls (dispatch and combine, forward and backward) per MoE layer, each of
    # batch x seq tokens x top-2 copies x hidden x 2 bytes, 7/8 of them leaving the device.
    held = 2 * 2048 * 2 * 2048 * 2
    assert step.all_to_all_bytes == pytest.approx(4 * 32 * held * 7 / 8)
    bw, lat = cluster.ring_link(8)
    assert step.all_to_all_s == pytest.approx(4 * 32 * perf.all_to_all_s(held, 8, bw, lat))
    assert step.exposed_s >= step.all_to_all_s and step.comm_s > step.all_to_all_s
    # ep = world: no expert replicas, so only the 0.9B replicated parameters are reduced.
    whole = perf.estimate(MIXTRAL, cluster, "ep", batch=2, precision="bf16", stages=16)
    ddp = perf.estimate(MIXTRAL, cluster, "ddp", batch=2, precision="bf16")
    assert whole.comm_s - whole.all_to_all_s < (ddp.comm_s * 0.9 / 12.9) * 1.1
    assert ddp.all_to_all_s == 0.0


def test_all_to_all_time_is_pairwise_exchanges() -> None:
    assert perf.all_to_all_s(8e9, 8, 100.0, 10.0) == pytest.approx(7 * 10e-6 + 7 / 8 * 8e9 / 100e9)
    assert perf.all_to_all_s(8e9, 1, 100.0, 10.0) == 0.0


def test_the_planner_picks_ep_for_an_moe_across_nodes_and_never_for_a_dense_model() -> None:
    cluster = hardware.preset("h100", nodes=4, gpus_per_node=8)
    plan = recommend(MIXTRAL, cluster, batch=2, precision="bf16")
    assert plan.strategy == "ep", plan.reason
    assert plan.layout == "dp 4 x ep 8"
    assert (
        plan.parallel_line == 'Parallel(strategy="ep", mesh={"dp": 4, "ep": 8}, precision="bf16")'
    )
    ep_ways = sorted(c.ways for c in plan.candidates if c.strategy == "ep")
    assert ep_ways == [2, 4, 8]  # inside a node (the ep axis stays in one), dividing 8 experts
    dense = recommend(DENSE, cluster, batch=2, precision="bf16")
    assert "ep" not in {c.strategy for c in dense.candidates}


def test_ep_sizes_must_divide_the_experts() -> None:
    six = transformer(
        "six", parameters=2_000_000_000, layers=8, hidden=1024, seq_len=1024,
        expert_parameters=1_500_000_000, num_experts=6, experts_per_token=2,
    )  # fmt: skip
    plan = recommend(six, hardware.preset("h100", nodes=1, gpus_per_node=8), batch=1)
    assert sorted(c.ways for c in plan.candidates if c.strategy == "ep") == [2]


def test_an_moe_description_computes_with_its_active_parameters_only() -> None:
    assert MIXTRAL.flops_per_sample < DENSE.flops_per_sample * 0.4
    assert MIXTRAL.routed_layers == 32 and DENSE.routed_layers == 0
    with pytest.raises(UsageError, match=r"^a mixture of experts needs num_experts >= 1 and 1 <="):
        ModelDesc(name="x", parameters=10, expert_parameters=5, num_experts=4, experts_per_token=5)
    with pytest.raises(UsageError, match=r"^expert parameters must be >= 0 and at most"):
        ModelDesc(name="x", parameters=10, expert_parameters=11)


def test_manygpu_plan_takes_an_moe_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from manygpu.cli.main import main

    shape = ["plan", "--params", "12.9e9", "--layers", "32", "--hidden", "2048", "--seq", "2048"]
    moe = ["--experts", "8", "--top-k", "2", "--expert-params", "12e9"]
    assert main([*shape, *moe, "--nodes", "4", "--batch", "2"]) == 0
    assert 'Parallel(strategy="ep", mesh={"dp": 4, "ep": 8}' in capsys.readouterr().out
    assert main([*shape, "--experts", "8"]) == 2
    assert "needs --experts, --top-k and --expert-params together" in capsys.readouterr().err
