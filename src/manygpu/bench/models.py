"""Workloads for ``manygpu bench train``: built-in models, or the user's ``module:function``.

A workload is a model plus a way to make a synthetic batch and a loss, so the
benchmark measures training steps, not a data set's download. Synthetic data
still travels through a real ``DataLoader`` (see :mod:`manygpu.bench.train`),
so the time spent waiting for batches is measured, not assumed to be zero.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from manygpu.bench import nets
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
    batch: int = 32
    """Samples per worker per step when the benchmark is not given ``--batch``."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise UsageError(f"workload {self.name!r}: model is a {type(self.model).__name__}")
        if not callable(self.make_batch) or not callable(self.loss):
            raise UsageError(f"workload {self.name!r}: make_batch and loss must be callables")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise UsageError(f"workload {self.name!r}: batch must be an integer >= 1")

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


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


SIZES = ("auto", "small", "full")
"""Built-in workload sizes: ``small`` for CPUs and tests, ``full`` the models GPUs are
measured with, ``auto`` picks by device (:func:`size_for`)."""


def size_for(size: str, device_type: str) -> str:
    """``small`` or ``full``: ``auto`` means full on a GPU and small on the CPU.

    A CPU runs GPT-2 small at a few sequences a second, which would make every
    test and first try take minutes; a GPU running the tiny models shows an MFU
    near 0 % that says nothing about the GPU.
    """
    if size not in SIZES:
        raise UsageError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if size == "auto":
        return "small" if device_type == "cpu" else "full"
    return size


def _demo_cnn(size: str) -> Workload:
    del size  # one size: it is the demo's model
    return Workload(name="demo-cnn", model=SimpleCNN(16), make_batch=_images(1, 16, 10))


def _resnet(size: str) -> Workload:
    if size == "full":
        return Workload(
            name="resnet50", model=nets.resnet50(), make_batch=_images(3, 224, 1000), batch=128
        )
    return Workload(name="resnet", model=nets.resnet_cnn(), make_batch=_images(3, 32, 10))


def gpt(shape: nets.GPTShape, name: str, batch: int) -> Workload:
    """A next-token workload for a GPT of ``shape`` (random tokens, full context)."""
    return Workload(
        name=name,
        model=nets.GPT(shape),
        make_batch=_tokens(shape.vocab, shape.context),
        batch=batch,
    )


def _gpt(size: str) -> Workload:
    if size == "full":
        return gpt(nets.GPT2_124M, "gpt2-124m", 16)
    return gpt(nets.GPT_TINY, "gpt", 32)


BUILTINS: dict[str, Callable[[str], Workload]] = {
    "demo-cnn": _demo_cnn,
    "resnet": _resnet,
    "gpt": _gpt,
}
"""Built-in workloads by name, each called with ``"small"`` or ``"full"``: the demo's
SimpleCNN (small, communication-bound); a CIFAR-style ResNet or ResNet-50 at
224x224; a byte-level GPT or GPT-2 small (124M, sequence 1024)."""


Factory = Callable[[], Workload]


def resolve(spec: str, size: str = "small") -> Factory:
    """The factory for a built-in name (at ``size``: small or full) or ``module:function``.

    Only imports and looks up; the factory runs on each worker. A user's
    function takes no arguments: its workload has one size, the user's.
    """
    if spec in BUILTINS:
        if size not in SIZES[1:]:
            raise UsageError(f"unknown size {size!r}; choose small or full")
        return functools.partial(BUILTINS[spec], size)
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


def build(spec: str, size: str = "small") -> Workload:
    """Resolve and call the factory; a factory returning something else is a usage error."""
    workload = resolve(spec, size)()
    if not isinstance(workload, Workload):
        raise UsageError(
            f"model {spec!r} returned a {type(workload).__name__}, "
            "not a manygpu.bench.models.Workload"
        )
    return workload
