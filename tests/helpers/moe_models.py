"""Tiny mixtures of experts for expert-parallel tests: a torchtitan-style model, an HF
Mixtral, and a Mixtral whose experts are a ModuleList as in transformers 4.x.

``GroupedMoE`` follows torchtitan's ``torchtitan/models/moe``: a token-choice
router (softmax, top-k), the routed copies sorted by expert, a
``GroupedExperts`` module with stacked ``w1``/``w2``/``w3`` ([num_experts, ...])
whose forward is ``(x_sorted, num_tokens_per_expert)``, and the outputs scaled
by the router's weights and summed back per token.

``ListedMoEModel`` has transformers 4.x's ``MixtralSparseMoeBlock`` (its forward
copied: softmax router, top-2 renormalised, a loop over the experts hit) with
``experts = nn.ModuleList`` of ``MixtralBlockSparseTop2MLP``-style ``w1``/``w2``/``w3``
MLPs, so its state dict names each expert (``layers.0.experts.3.w1.weight``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, EXPERTS, TOP_K, VOCAB, LAYERS = 32, 48, 4, 2, 64, 2


class GroupedExperts(nn.Module):
    """SwiGLU experts with stacked weights; rows arrive sorted by expert."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.1)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # Runs on whatever experts it holds: len(counts) == w1.shape[0] (all, or a rank's).
        outs = []
        chunks = torch.split(x, num_tokens_per_expert.tolist())
        for i, rows in enumerate(chunks):
            h = F.silu(rows @ self.w1[i].T) * (rows @ self.w3[i].T)
            outs.append(h @ self.w2[i].T)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class MoE(nn.Module):
    """Token-choice top-k routing over grouped experts (torchtitan's MoE, no shared expert)."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, num_experts: int = EXPERTS) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.num_experts = num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = F.softmax(self.router(flat), dim=-1)
        top_w, top_i = torch.topk(scores, TOP_K, dim=-1)
        choice = top_i.reshape(-1)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=self.num_experts)
        token = order // TOP_K
        out = self.experts(flat[token], counts) * top_w.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, token, out).view_as(x)


class CappedMoE(MoE):
    """``MoE`` whose experts take at most ``ceil(factor * tokens * k / E)`` copies each,
    the rest dropped (manygpu's ``Capacity``: over the global batch under EP)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, capacity_factor: float) -> None:
        super().__init__(dim, hidden, num_experts)
        from manygpu.strategies.expert.capacity import Capacity

        self.capacity = Capacity(capacity_factor, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = F.softmax(self.router(flat), dim=-1)
        top_w, top_i = torch.topk(scores, TOP_K, dim=-1)
        kept = self.capacity(top_i).reshape(-1)
        choice = top_i.reshape(-1)
        order = torch.argsort(choice, stable=True)
        order = order[kept[order]]
        counts = torch.bincount(choice[order], minlength=self.num_experts)
        token = order // TOP_K
        out = self.experts(flat[token], counts) * top_w.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, token, out).view_as(x)


class GroupedMoEModel(nn.Module):
    """Embedding, ``LAYERS`` pre-norm MoE blocks, a head: a language model in miniature;
    with ``capacity_factor``, blocks that drop copies past their experts' capacity."""

    def __init__(
        self,
        layers: int = LAYERS,
        num_experts: int = EXPERTS,
        dim: int = DIM,
        hidden: int = HIDDEN,
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.layers = nn.ModuleList(
            MoE(dim, hidden, num_experts)
            if capacity_factor is None
            else CappedMoE(dim, hidden, num_experts, capacity_factor)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for norm, moe in zip(self.norms, self.layers, strict=True):
            h = h + moe(norm(h))
        return self.head(h)


def grouped_model(
    seed: int = 7, num_experts: int = EXPERTS, capacity_factor: float | None = None
) -> GroupedMoEModel:
    torch.manual_seed(seed)
    return GroupedMoEModel(num_experts=num_experts, capacity_factor=capacity_factor)


def mixtral(seed: int = 7, num_experts: int = EXPERTS, aux: bool = False) -> Any:
    """A tiny Hugging Face Mixtral (4 experts, top-2, hidden 32, 2 layers), eager attention."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=num_experts,
        num_experts_per_tok=TOP_K, max_position_embeddings=64, output_router_logits=aux,
        router_aux_loss_coef=0.02, attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return MixtralForCausalLM(config)


class ExpertMLP(nn.Module):
    """transformers 4.x ``MixtralBlockSparseTop2MLP``: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class SparseMoeBlock(nn.Module):
    """transformers 4.x ``MixtralSparseMoeBlock`` (no jitter): returns (hidden, router_logits)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = TOP_K) -> None:
        super().__init__()
        self.hidden_dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(dim, hidden) for _ in range(num_experts))
        self.jitter_noise = 0.0

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros(
            (batch_size * sequence_length, hidden_dim),
            dtype=hidden_states.dtype, device=hidden_states.device,
        )  # fmt: skip
        mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit.reshape(-1).tolist():
            idx, top_x = torch.where(mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


class ListedMoEModel(nn.Module):
    """``GroupedMoEModel``'s shape with 4.x Mixtral blocks; also returns the router logits."""

    def __init__(
        self, layers: int = LAYERS, num_experts: int = EXPERTS, dim: int = DIM, hidden: int = HIDDEN
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.layers = nn.ModuleList(SparseMoeBlock(dim, hidden, num_experts) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        h, router_logits = self.embed(tokens), []
        for norm, moe in zip(self.norms, self.layers, strict=True):
            out, logits = moe(norm(h))
            h = h + out
            router_logits.append(logits)
        return self.head(h), tuple(router_logits)


def listed_model(seed: int = 7, num_experts: int = EXPERTS) -> ListedMoEModel:
    torch.manual_seed(seed)
    return ListedMoEModel(num_experts=num_experts)
