"""Pipeline schedules with several stages per rank: where stages sit, what each
schedule needs (one line before any group), and the planner's bubble for each.

The schedules' equivalence with one process runs on real ranks in
tests/distributed/test_pipeline.py.
"""

from __future__ import annotations

import pytest
from torch import nn

from manygpu import UsageError
from manygpu.plan.desc import transformer
from manygpu.plan.hardware import preset
from manygpu.plan.perf import estimate
from manygpu.runtime.cluster import detect_cluster
from manygpu.strategies import Pipeline
from manygpu.strategies.base import JobOptions
from manygpu.strategies.pipeline.schedules import (
    SCHEDULES,
    bubble_fraction,
    last_stage_rank,
    microbatch_refusal,
    stages_of_rank,
)
from manygpu.strategies.pipeline.strategy import PipelineStrategy


def _cluster(world: int):
    return detect_cluster(
        {
            "RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
        }
    )  # fmt: skip


def test_every_stage_sits_on_exactly_one_rank_looped_or_in_a_v() -> None:
    for pp in (1, 2, 3, 4):
        looped = [s for r in range(pp) for s in stages_of_rank(r, pp, 3, "loop")]
        assert sorted(looped) == list(range(3 * pp))
        v = [stages_of_rank(r, pp, 2, "v") for r in range(pp)]
        assert sorted(s for held in v for s in held) == list(range(2 * pp))
        assert 2 * pp - 1 in v[last_stage_rank(pp, "v")]  # rank 0 computes the loss
        assert 3 * pp - 1 in stages_of_rank(last_stage_rank(pp, "loop"), pp, 3, "loop")


def test_bubbles_shrink_from_1f1b_to_interleaved_to_zero_bubble() -> None:
    pp, m = 4, 8
    assert bubble_fraction("1f1b", pp, m) == pytest.approx(3 / 8)
    assert bubble_fraction("gpipe", pp, m) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved-1f1b", pp, m, 2) == pytest.approx(3 / 16)
    assert bubble_fraction("interleaved-1f1b", pp, m, 4) == pytest.approx(3 / 32)
    assert bubble_fraction("interleaved-zero-bubble", pp, m, 2) == pytest.approx(3 / 48)
    assert bubble_fraction("zbv", pp, m) == bubble_fraction("dualpipev", pp, m)
    assert bubble_fraction("zbv", pp, m) == pytest.approx(3 / 48)
    assert bubble_fraction("1f1b", 1, m) == 0.0


def test_the_planner_counts_each_schedules_bubble() -> None:
    desc = transformer("1B", parameters=10**9, layers=16, hidden=2048, seq_len=1024)
    cluster = preset("h100")
    steps = {
        name: estimate(desc, cluster, "pipeline", batch=4, stages=4, microbatches=8,
                       schedule=name).compute_s
        for name in SCHEDULES
    }  # fmt: skip
    ideal = estimate(desc, cluster, "pipeline", batch=4, stages=4, microbatches=8).ideal_s
    for name, compute in steps.items():
        assert compute == pytest.approx(ideal * (1 + bubble_fraction(name, 4, 8)))
    assert steps["1f1b"] > steps["interleaved-1f1b"] > steps["interleaved-zero-bubble"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"schedule": "zb"}, "unknown pipeline schedule 'zb'; choose one of gpipe, 1f1b"),
        ({"schedule": "zbv", "virtual_stages": 3}, "runs 2 stage.s. per rank, not virtual_st"),
        ({"schedule": "1f1b", "virtual_stages": 2}, "choose interleaved-1f1b, interleaved-ze"),
        ({"schedule": "interleaved-1f1b", "virtual_stages": 1}, "give virtual_stages >= 2"),
        ({"schedule": "interleaved-1f1b", "virtual_stages": 0}, "integer >= 1, got 0"),
    ],
)
def test_a_schedule_given_the_wrong_stages_per_rank_is_one_line(
    options: dict[str, object], match: str
) -> None:
    with pytest.raises(UsageError, match=match):
        Pipeline(loss_fn=nn.functional.mse_loss, **options)


@pytest.mark.parametrize(
    ("schedule", "pp", "micro", "match"),
    [
        ("1f1b", 4, 3, "at least one micro-batch per stage: microbatches=3 < 4"),
        ("dualpipev", 2, 3, "as many micro-batches as stages: microbatches=3 < 4"),
        (
            "interleaved-1f1b",
            4,
            9,
            "microbatches=9 is not a multiple of its 2 rounds; use e.g. 4, 5, 6",
        ),
        ("interleaved-zero-bubble", 2, 5, "not a multiple of its 2 rounds"),
    ],
)
def test_too_few_or_uneven_micro_batches_are_refused_before_any_group(
    schedule: str, pp: int, micro: int, match: str
) -> None:
    opts = Pipeline(loss_fn=nn.functional.mse_loss, microbatches=micro, schedule=schedule)
    with pytest.raises(UsageError, match=match):
        PipelineStrategy.validate_world(_cluster(pp), opts, JobOptions())


def test_schedules_that_fit_pass_and_torch_agrees() -> None:
    for schedule, pp, micro in [
        ("interleaved-1f1b", 4, 3), ("interleaved-1f1b", 4, 12), ("zbv", 2, 1),
        ("dualpipev", 2, 4), ("gpipe", 4, 1),
    ]:  # fmt: skip
        assert microbatch_refusal(schedule, pp, 2, micro) is None


def test_split_points_count_every_virtual_stage() -> None:
    opts = Pipeline(
        loss_fn=nn.functional.mse_loss, schedule="interleaved-1f1b", split_points=(2, 4, 6)
    )
    PipelineStrategy.validate_world(_cluster(2), opts, JobOptions())  # 2 ranks x 2 = 4 stages
    with pytest.raises(UsageError, match=r"pipeline has 4 \(mesh pp=2 x 2 virtual stages\)"):
        PipelineStrategy.validate_world(
            _cluster(2),
            Pipeline(loss_fn=nn.functional.mse_loss, schedule="zbv", split_points=(3,)),
            JobOptions(),
        )


def test_zero_bubble_under_torch_compile_is_refused_in_one_line() -> None:
    from manygpu.strategies.options import CompileOptions

    job = JobOptions(compile=CompileOptions())
    for schedule in ("interleaved-zero-bubble", "zbv", "dualpipev"):
        opts = Pipeline(loss_fn=nn.functional.mse_loss, schedule=schedule)
        with pytest.raises(UsageError, match="splits each backward in two"):
            PipelineStrategy.validate_features(opts, job)
    opts = Pipeline(loss_fn=nn.functional.mse_loss, schedule="interleaved-1f1b")
    PipelineStrategy.validate_features(opts, job)
