"""Tiny mixtures of experts for expert-parallel tests: a torchtitan-style model, an HF Mixtral.

``GroupedMoE`` follows torchtitan's ``torchtitan/models/moe``: a token-choice
router (softmax, top-k), the routed copies sorted by expert, a
``GroupedExperts`` module with stacked ``w1``/``w2``/``w3`` ([num_experts, ...])
whose forward is ``(x_sorted, num_tokens_per_expert)``, and the outputs scaled
by the router's weights and summed back per token.
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


class GroupedMoEModel(nn.Module):
    """Embedding, ``LAYERS`` pre-norm MoE blocks, a head: a language model in miniature."""

    def __init__(
        self, layers: int = LAYERS, num_experts: int = EXPERTS, dim: int = DIM, hidden: int = HIDDEN
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.layers = nn.ModuleList(MoE(dim, hidden, num_experts) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for norm, moe in zip(self.norms, self.layers, strict=True):
            h = h + moe(norm(h))
        return self.head(h)


def grouped_model(seed: int = 7, num_experts: int = EXPERTS) -> GroupedMoEModel:
    torch.manual_seed(seed)
    return GroupedMoEModel(num_experts=num_experts)


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
