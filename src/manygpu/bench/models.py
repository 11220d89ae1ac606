"""Workloads for ``manygpu bench train``: built-in models, or the user's ``module:function``.

A workload is a model plus a way to make a synthetic batch and a loss, so the
benchmark measures training steps, not a data set's download. Synthetic data
still travels through a real ``DataLoader`` (see :mod:`manygpu.bench.train`),
so the time spent waiting for batches is measured, not assumed to be zero.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from manygpu.demo.model import SimpleCNN
from manygpu.errors import UsageError

BatchFn = Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _flat_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classifiers and for language models (flattened over tokens)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one training step runs. A user's ``module:function`` returns one of these."""

    name: str
    """Shown in tables and JSON."""
    model: nn.Module
    """A fresh model on the CPU; the benchmark moves and wraps it."""
    make_batch: BatchFn
    """``make_batch(n, generator)`` -> ``(inputs, targets)`` for ``n`` samples, on the CPU."""
    loss: LossFn = field(default=_flat_cross_entropy)
    """``loss(model(inputs), targets)``; cross-entropy (flattened) by default."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise UsageError(f"workload {self.name!r}: model is a {type(self.model).__name__}")
        if not callable(self.make_batch) or not callable(self.loss):
            raise UsageError(f"workload {self.name!r}: make_batch and loss must be callables")

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


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
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

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


class GPTBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class SmallGPT(nn.Module):
    """A byte-level GPT (token + position embeddings, blocks, tied-free head)."""

    def __init__(
        self, vocab: int = 256, context: int = 64, dim: int = 128, layers: int = 4, heads: int = 4
    ) -> None:
        super().__init__()
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(GPTBlock(dim, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def _images(channels: int, side: int, classes: int) -> BatchFn:
    def make(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, channels, side, side, generator=gen)
        return x, torch.randint(0, classes, (n,), generator=gen)

    return make


def _tokens(vocab: int, context: int) -> BatchFn:
    def make(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.randint(0, vocab, (n, context + 1), generator=gen)
        return seq[:, :-1], seq[:, 1:]

    return make


def _demo_cnn() -> Workload:
    return Workload(name="demo-cnn", model=SimpleCNN(16), make_batch=_images(1, 16, 10))


def _resnet() -> Workload:
    return Workload(name="resnet", model=resnet_cnn(), make_batch=_images(3, 32, 10))


def _gpt() -> Workload:
    return Workload(name="gpt", model=SmallGPT(), make_batch=_tokens(256, 64))


BUILTINS: dict[str, Callable[[], Workload]] = {
    "demo-cnn": _demo_cnn,
    "resnet": _resnet,
    "gpt": _gpt,
}
"""Built-in workloads: the demo's SimpleCNN (small, communication-bound), a
ResNet-style CNN (compute-bound) and a small GPT."""


def resolve(spec: str) -> Callable[[], Workload]:
    """The factory for a built-in name or an importable ``module:function``.

    Only imports and looks up; the factory runs on each worker.
    """
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" not in spec:
        raise UsageError(
            f"unknown model {spec!r}; choose one of {', '.join(BUILTINS)} "
            "or give module:function returning a manygpu.bench.models.Workload"
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"model {spec!r} is not of the form module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's to fix
        raise UsageError(
            f"cannot import module {module_name!r} for model {spec!r}: {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"module {module_name!r} has no function {attr!r} (model {spec!r})")
    return fn


def build(spec: str) -> Workload:
    """Resolve and call the factory; a factory returning something else is a usage error."""
    workload = resolve(spec)()
    if not isinstance(workload, Workload):
        raise UsageError(
            f"model {spec!r} returned a {type(workload).__name__}, "
            "not a manygpu.bench.models.Workload"
        )
    return workload
