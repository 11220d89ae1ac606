"""Expert parallelism's pure logic, no process group: finding experts, the route's
arithmetic, the sort of routed copies and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from jobs import two_rank_cluster
from moe_models import GroupedExperts, SparseMoeBlock, grouped_model, listed_model, mixtral
from torch import nn

from manygpu import ExpertParallel, MeshShape, Parallel, UsageError
from manygpu.core.config import ParallelConfig
from manygpu.strategies.expert.capacity import Capacity, capacity, keep_mask
from manygpu.strategies.expert.dispatch import route, sort_routed
from manygpu.strategies.expert.finding import check_divisible, find_experts
from manygpu.strategies.expert.fsdp import check_fsdp_mesh


def test_experts_are_found_by_structure_in_mixtral_and_grouped_models() -> None:
    hf = find_experts(mixtral())
    assert [s.path for s in hf] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert {(s.kind, s.num_experts, s.params) for s in hf} == {
        ("routed", 4, ("gate_up_proj", "down_proj"))
    }
    titan = find_experts(grouped_model(num_experts=8))
    assert [(s.path, s.kind, s.num_experts) for s in titan] == [
        ("layers.0.experts", "grouped", 8), ("layers.1.experts", "grouped", 8)
    ]  # fmt: skip


def test_a_qwen2_moe_block_is_found_too() -> None:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    sites = find_experts(Qwen2MoeForCausalLM(config))
    assert [(s.path, s.kind, s.num_experts) for s in sites] == [
        ("model.layers.0.mlp.experts", "routed", 4)
    ]


class _Renamed(GroupedExperts):
    """Grouped experts its parent calls ``ffn``: not found by structure."""


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn = _Renamed(4, 6, 4)
        self.head = nn.Linear(4, 4)


def test_named_experts_by_class_name_class_or_predicate() -> None:
    with pytest.raises(UsageError, match=r"found no experts in _Holder .*experts='MyExperts'"):
        find_experts(_Holder())
    for chosen in ("_Renamed", (_Renamed,), lambda path, m: path == "ffn"):
        assert [s.path for s in find_experts(_Holder(), chosen)] == ["ffn"]
    with pytest.raises(UsageError, match=r"no module matching experts='Nope' in _Holder"):
        find_experts(_Holder(), "Nope")


def test_a_module_list_of_experts_beside_a_router_is_found() -> None:
    sites = find_experts(listed_model(num_experts=8))
    assert [(s.path, s.kind, s.num_experts, s.top_k) for s in sites] == [
        ("layers.0.experts", "listed", 8, 2), ("layers.1.experts", "listed", 8, 2)
    ]  # fmt: skip
    assert sites[0].params == ("w1.weight", "w2.weight", "w3.weight")
    check_divisible(sites, 4)
    with pytest.raises(UsageError, match=r"cannot split the 8 experts of 'layers.0.experts'"):
        check_divisible(sites, 3)


def _block(**changes: object) -> nn.Module:
    block = SparseMoeBlock(4, 6, 4)
    for name, value in changes.items():
        setattr(block, name, value)
    return nn.ModuleDict({"moe": block})


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"gate": nn.Linear(4, 3)}, r"cannot route moe.experts .*needs a router 'gate'"),
        ({"gate": nn.Identity()}, r"cannot route moe.experts .*needs a router 'gate'"),
        ({"top_k": None}, r"cannot route moe.experts .*needs 'top_k' .*not None"),
        ({"jitter_noise": 0.01}, r"cannot route .*jitter_noise is random.*set jitter_noise=0"),
        ({"capacity_factor": 1.25}, r"drops tokens past a capacity \(capacity_factor=1.25\)"),
    ],
)
def test_a_module_list_block_ep_cannot_run_is_refused_in_one_line(
    changes: dict[str, object], match: str
) -> None:
    with pytest.raises(UsageError, match=match) as info:
        find_experts(_block(**changes))
    assert "\n" not in str(info.value)


def test_module_list_experts_of_different_shapes_are_refused_in_one_line() -> None:
    model = _block()
    model["moe"].experts[1].w1 = nn.Linear(4, 7, bias=False)  # type: ignore[index]
    with pytest.raises(UsageError, match=r"cannot split moe.experts .*one class") as info:
        find_experts(model)
    assert "\n" not in str(info.value)


def test_a_capacity_factor_beside_stacked_experts_is_refused_in_one_line() -> None:
    model = grouped_model()
    model.layers[0].capacity_factor = 1.0  # type: ignore[assignment]
    with pytest.raises(UsageError, match=r"run layers.0.experts \(GroupedExperts\): it drops"):
        find_experts(model)
    model.layers[0].capacity_factor = None  # type: ignore[assignment]
    assert len(find_experts(model)) == 2


def test_an_odd_experts_module_or_forward_is_refused_in_one_line() -> None:
    holder = _Holder()
    with pytest.raises(UsageError, match=r"cannot split head \(Linear\): .*stacked") as info:
        find_experts(holder, "Linear")
    assert "\n" not in str(info.value)

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 2, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(UsageError, match=r"cannot call experts \(Odd\): its forward must be"):
        find_experts(nn.ModuleDict({"experts": Odd()}))


def test_num_experts_must_divide_by_ep() -> None:
    sites = find_experts(grouped_model(num_experts=6))
    check_divisible(sites, 2)
    check_divisible(sites, 3)
    with pytest.raises(
        UsageError, match=r"^cannot split the 6 experts of 'layers.0.experts' over ep=4"
    ):
        check_divisible(sites, 4)


def test_the_route_sends_runs_of_experts_and_orders_arrivals_by_expert() -> None:
    # ep=2, 2 experts per rank. This rank's copies per global expert:
    counts = torch.tensor([3, 0, 1, 2])
    # What rank 0 and rank 1 send to this rank's two experts (an expert with none from rank 1).
    received = torch.tensor([[2, 1], [0, 4]])
    plan = route(counts, received)
    assert plan.send == [3, 3] and plan.recv == [3, 4] and plan.local_counts == [2, 5]
    # Arrivals are source-major: rows 0-1 (src 0, e0), 2 (src 0, e1), 3-6 (src 1, e1).
    assert plan.order.tolist() == [0, 1, 2, 3, 4, 5, 6]
    received = torch.tensor([[1, 1], [2, 0]])  # rows: s0e0, s0e1, s1e0, s1e0
    assert route(counts, received).order.tolist() == [0, 2, 3, 1]


def test_routed_copies_sort_by_expert_and_drop_the_sentinel() -> None:
    index = torch.tensor([[2, 0], [1, 4], [0, 2]])  # 4: Hugging Face's "no expert"
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    picked = sort_routed(index, weights, num_experts=4)
    assert picked.counts.tolist() == [2, 1, 2, 0]
    assert picked.token.tolist() == [0, 2, 1, 0, 2]
    assert picked.weight.tolist() == pytest.approx([0.4, 0.5, 0.7, 0.6, 0.5])


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"strategy": "fsdp", "mesh": {"ep": 2}}, r"'fsdp' cannot use mesh dimension\(s\) ep=2"),
        ({"strategy": "ddp", "mesh": {"ep": 2}}, r"'ddp' cannot use mesh dimension\(s\) ep=2"),
        ({"strategy": "tensor", "mesh": {"ep": 2}}, r"'tensor' cannot use mesh dimension\(s\) ep"),
        (
            {"strategy": "ep", "mesh": {"ep": 2, "tp": 2}},
            r"'ep' cannot use mesh dim.*tp=2; it takes dp, fsdp, ep",
        ),
        ({"strategy": ExpertParallel(), "mesh": {"ep": 4}}, r"ep\(4\) = 4 != WORLD_SIZE\(2\)"),
    ],
)
def test_an_ep_axis_where_it_cannot_work_is_one_line(fields: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        Parallel(cluster=two_rank_cluster(), **fields)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_fsdp_composes_with_ep_but_not_with_dp_too() -> None:
    check_fsdp_mesh({"dp": 1, "fsdp": 2, "ep": 2})
    check_fsdp_mesh({"dp": 2, "fsdp": 1, "ep": 2})
    with pytest.raises(UsageError, match=r"^strategy 'ep' composes fsdp with ep, or dp with ep"):
        check_fsdp_mesh({"dp": 2, "fsdp": 2, "ep": 2})


def test_the_option_takes_classes_names_or_a_predicate() -> None:
    assert ExpertParallel(experts="MixtralExperts").experts == ("MixtralExperts",)
    assert ExpertParallel(experts=GroupedExperts).experts == (GroupedExperts,)
    assert callable(ExpertParallel(experts=lambda path, m: True).experts)
    with pytest.raises(UsageError, match=r"^ExpertParallel\(experts=...\) takes nn.Module classes"):
        ExpertParallel(experts=(3,))  # type: ignore[arg-type]


def test_a_mesh_with_ep_picks_ep_and_ep_splits_the_data() -> None:
    assert ParallelConfig(mesh={"ep": 2}).resolved_strategy(2) == "ep"
    assert ParallelConfig(strategy="ep").resolved_strategy(2) == "ep"
    shape = MeshShape(dp=2, ep=2).resolve(4)
    assert [shape.data_rank(r) for r in range(4)] == [0, 1, 2, 3] and shape.data_size == 4


def test_capacity_keeps_the_first_copies_of_the_global_batch() -> None:
    assert capacity(1.0, 32, 2, 4) == 16 and capacity(1.25, 10, 2, 4) == 7
    choices = torch.tensor([0, 1, 0, 0, 2, 0])
    # One process (nothing before): expert 0's first two copies fit, its 3rd and 4th drop.
    assert keep_mask(choices, torch.zeros(4, dtype=torch.long), 2).tolist() == [
        True, True, True, False, True, False
    ]  # fmt: skip
    # A later data rank: expert 0 already took one place on the ranks before it.
    before = torch.tensor([1, 2, 0, 0])
    assert keep_mask(choices, before, 2).tolist() == [True, False, False, False, True, False]
    keep = Capacity(1.0, 4)(torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]]))  # 2 places
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
