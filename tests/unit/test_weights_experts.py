"""Hugging Face MoE files (each expert stored apart) load into models that stack experts.

``save_pretrained`` of a transformers 5 Mixtral / Qwen2-MoE writes the Hub's
per-expert layout; :func:`load_weights` must fill the stacked ``gate_up_proj`` /
``down_proj`` exactly (no arithmetic: equal bit for bit), and a block of experts
must be read from those experts' tensors alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from moe_models import mixtral

from manygpu.errors import CheckpointError
from manygpu.weights import load_weights
from manygpu.weights.experts import StackedExperts, stack_experts
from manygpu.weights.sources import SlicedSource, open_source


def _qwen(seed: int) -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(config)


@pytest.mark.parametrize("build", [mixtral, _qwen], ids=["mixtral", "qwen2_moe"])
def test_a_per_expert_hf_file_loads_into_stacked_experts(build: Any, tmp_path: Path) -> None:
    saved = build(seed=1)
    saved.save_pretrained(tmp_path)
    keys = list(open_source(tmp_path).entries)
    assert any(".experts.0." in k for k in keys) and not any("gate_up_proj" in k for k in keys)
    fresh = build(seed=2)
    report = load_weights(fresh, tmp_path)
    want = saved.state_dict()
    assert report.tensors == len(want)
    assert [n for n, v in fresh.state_dict().items() if not torch.equal(v, want[n])] == []


class _Counting(SlicedSource):
    """A source that records which keys were read."""

    def __init__(self, inner: SlicedSource) -> None:
        self.inner, self.where, self.entries, self.seen = inner, inner.where, inner.entries, []

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        self.seen.append(name)
        return self.inner.read(name, index)


def test_a_block_of_experts_reads_those_experts_only(tmp_path: Path) -> None:
    saved = mixtral(seed=1)
    saved.save_pretrained(tmp_path)
    counting = _Counting(open_source(tmp_path))
    names = list(saved.state_dict())
    stacked = stack_experts(counting, names)
    assert isinstance(stacked, StackedExperts)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    whole = saved.state_dict()[name]
    assert stacked.entries[name].shape == tuple(whole.shape)
    rows = whole.shape[1]
    block = (slice(2, 4), slice(rows // 4, 3 * rows // 4), slice(0, whole.shape[2]))
    assert torch.equal(stacked.read(name, block), whole[block])  # gate's and up's rows both
    assert sorted(set(counting.seen)) == [
        f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
        for e in (2, 3)
        for w in ("w1", "w3")
    ]
    assert stack_experts(counting, counting.entries) is counting  # a model named as the file


def test_a_missing_expert_is_named_as_the_files_keys(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    saved = mixtral(seed=1)
    saved.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(file)
    del state["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"lacks 2 of the model's tensors .*layers.0.mlp.experts"
    ):
        load_weights(mixtral(seed=2), tmp_path)
