"""FSDP2 units' outputs are unviewed without changing what the module returns."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch
from torch import nn

from manygpu.strategies.fsdp.outputs import unview_outputs

Pair = namedtuple("Pair", "a b")


class _Returns(nn.Module):
    """Returns views of its parameter in the container it was built with."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2, 3))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> object:
        y = (self.w * x).view(3, 2)
        if self.kind == "tensor":
            return y
        if self.kind == "namedtuple":
            return Pair(y, 7)
        if self.kind == "dict":
            return OrderedDict(logits=y, n=7)
        return [y, (y, 7)]


def _views(value: object) -> list[bool]:
    if isinstance(value, torch.Tensor):
        return [value._base is not None]
    if isinstance(value, dict):
        return [v for item in value.values() for v in _views(item)]
    if isinstance(value, tuple | list):
        return [v for item in value for v in _views(item)]
    return []


def test_views_become_tensors_of_their_own_in_any_container() -> None:
    for kind in ("tensor", "namedtuple", "dict", "list"):
        module = _Returns(kind)
        assert any(_views(module(torch.tensor(2.0))))
        unview_outputs(module)
        out = module(torch.tensor(2.0))
        assert _views(out) and not any(_views(out)), kind
        assert type(out) is {"tensor": torch.Tensor, "namedtuple": Pair, "dict": OrderedDict,
                             "list": list}[kind]  # fmt: skip


def test_gradients_pass_through_and_an_in_place_op_is_safe() -> None:
    module = _Returns("tensor")
    unview_outputs(module)
    out = module(torch.tensor(2.0))
    seen: list[torch.Tensor] = []
    out.register_hook(seen.append)
    out.add_(1)  # on a view this would have dropped the hook
    out.sum().backward()
    assert len(seen) == 1
    assert torch.equal(module.w.grad, torch.full((2, 3), 2.0))
