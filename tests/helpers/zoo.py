"""Models people actually train, tiny: the equivalence tests' test subjects.

Each entry builds a model from the *current* torch RNG (callers seed per rank
on purpose, to prove that ``prepare`` makes every replica start equal), gives
batches for it, and a mean-reduced loss. Hugging Face models are built from
tiny local configs (no download).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, HEADS = 64, 8, 32, 4


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/out projections (no bias on q/k/v)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.out_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = DIM // HEADS
        # -1 heads: under tensor parallel each rank holds HEADS / tp of them.
        q, k, v = (
            p(x).view(b, t, -1, hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's layout: token + position embeddings, ModuleList of blocks, tied head."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


def gpt_sequential(layers: int = 4) -> nn.Sequential:
    """The same GPT as stages can cut it: an nn.Sequential, head untied (stages differ)."""
    return nn.Sequential(
        Embed(), *[Block() for _ in range(layers)], nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)
    )


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def resnet() -> nn.Module:
    """resnet18's layout in miniature: stem, stages of BasicBlocks in Sequentials, fc."""
    try:
        import torchvision  # type: ignore[import-untyped]

        return torchvision.models.resnet18(num_classes=4)
    except Exception:  # not installed, or built for another torch
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Sequential(BasicBlock(8), BasicBlock(8)),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )


def _quiet_transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def hf_gpt2() -> nn.Module:
    t = _quiet_transformers()
    cfg = t.GPT2Config(
        n_layer=2,
        n_embd=DIM,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return t.GPT2LMHeadModel(cfg)


def hf_llama() -> nn.Module:
    t = _quiet_transformers()
    cfg = t.LlamaConfig(
        hidden_size=DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    return t.LlamaForCausalLM(cfg)


def hf_bert() -> nn.Module:
    t = _quiet_transformers()
    cfg = t.BertConfig(
        hidden_size=DIM,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return t.BertForSequenceClassification(cfg)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(out).reshape(-1, VOCAB), y.reshape(-1))


def class_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(out), y)


def _tokens(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _sentences(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (n, SEQ), generator=gen), torch.randint(
        0, 3, (n,), generator=gen
    )


def _images(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen)


@dataclass(frozen=True)
class Entry:
    """A model of the zoo: how to build it, its data and its loss."""

    build: Callable[[], nn.Module]
    data: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]


ZOO: dict[str, Entry] = {
    "gpt": Entry(GPT, _tokens, lm_loss),
    "gpt_seq": Entry(gpt_sequential, _tokens, lm_loss),
    "hf_gpt2": Entry(hf_gpt2, _tokens, lm_loss),
    "hf_llama": Entry(hf_llama, _tokens, lm_loss),
    "hf_bert": Entry(hf_bert, _sentences, class_loss),
    "resnet": Entry(resnet, _images, class_loss),
}


def dataset(name: str, n: int) -> torch.utils.data.TensorDataset:
    """``n`` samples for zoo model ``name``, the same in every process."""
    x, y = ZOO[name].data(n, torch.Generator().manual_seed(11))
    return torch.utils.data.TensorDataset(x, y)


# -- optimizers people use ------------------------------------------------------
def _decay_groups(model: nn.Module, wd: float = 0.1) -> list[dict[str, Any]]:
    """nanoGPT's split: decay matrices, not biases and norms (2-D and up decay)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda m: torch.optim.AdamW(_decay_groups(m), lr=3e-3, betas=(0.9, 0.95)),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=3e-3),
    "sgd_nesterov": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4
    ),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3),
}


def warmup_cosine(opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over 2 steps, then cosine to 10%: the usual LLM schedule."""

    def factor(step: int) -> float:
        if step < 2:
            return (step + 1) / 2
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 2) / max(1, total - 2)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
