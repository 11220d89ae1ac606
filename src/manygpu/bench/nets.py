"""The networks behind ``bench train``'s built-in workloads, in plain torch.

Two sizes of each: small ones that make a CPU test run in seconds, and the
models people measure GPUs with (GPT-2 small and medium, ResNet-50 at 224x224),
so a GPU's MFU reads something meaningful. Plain torch, not torchvision or
transformers, so the benchmark needs nothing beyond torch and every variant of
``bench/gpu_defaults.py`` trains the very same module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """A residual block's shortcut: identity, or a 1x1 convolution where the shape changes."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with batch norm and an identity (or 1x1) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.short = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.short(x))


def resnet_cnn(width: int = 32, classes: int = 10) -> nn.Module:
    """A CIFAR-style ResNet (3 stages x 2 blocks, widths w, 2w, 4w) for 3x32x32 images.

    With ``width=32``: 0.7 M parameters and ~0.3 GFLOP per sample forward,
    so a step is compute-bound on a CPU core: the case that should scale.
    """
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
    ]
    cin = width
    for i, cout in enumerate((width, 2 * width, 4 * width)):
        layers += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 down, 3x3 (carrying the stride, as torchvision's v1.5), 1x1 up x4."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.short = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.short(x))


def resnet50(classes: int = 1000) -> nn.Module:
    """ResNet-50 for 3x224x224 images: torchvision's layout and parameter count (25,557,032).

    About 4.1 G multiply-adds per image forward, the figure published GPU
    throughputs (img/s) are quoted for.
    """
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


@dataclass(frozen=True, kw_only=True)
class GPTShape:
    """The sizes of a GPT."""

    vocab: int
    """Tokens in the vocabulary."""
    context: int
    """Sequence length (learned position embeddings of this many positions)."""
    dim: int
    """Model width."""
    layers: int
    """Transformer blocks."""
    heads: int
    """Attention heads (``dim`` must divide by it)."""
    tied: bool
    """The output head shares the token embedding's weight (as GPT-2 does)."""


GPT_TINY = GPTShape(vocab=256, context=64, dim=128, layers=4, heads=4, tied=False)
"""A byte-level GPT small enough for CPU tests (0.87 M parameters)."""
GPT2_124M = GPTShape(vocab=50257, context=1024, dim=768, layers=12, heads=12, tied=True)
"""GPT-2 small: 124 M parameters."""
GPT2_355M = GPTShape(vocab=50257, context=1024, dim=1024, layers=24, heads=16, tied=True)
"""GPT-2 medium: 355 M parameters."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``.

    ``is_causal=True`` instead of a mask tensor lets torch pick its flash or
    memory-efficient kernels on a GPU, as a hand-written GPT (nanoGPT) does.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, transformer blocks, a final norm and a vocabulary head."""

    def __init__(self, shape: GPTShape = GPT_TINY) -> None:
        super().__init__()
        if shape.dim % shape.heads:
            raise ValueError(f"GPT width {shape.dim} does not divide into {shape.heads} heads")
        self.shape = shape
        self.tok = nn.Embedding(shape.vocab, shape.dim)
        self.pos = nn.Embedding(shape.context, shape.dim)
        self.blocks = nn.Sequential(
            *(GPTBlock(shape.dim, shape.heads) for _ in range(shape.layers))
        )
        self.ln = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=not shape.tied)
        if shape.tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))
