"""Misuse of the API is refused at once, in one line, not later inside torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from manygpu import Parallel, UsageError


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_preparing_a_model_or_optimizer_twice_is_refused(strategy: str) -> None:
    with Parallel(strategy=strategy) as par:
        model = nn.Linear(3, 2)
        wrapped = par.prepare(model)
        for again in (model, wrapped):
            with pytest.raises(UsageError, match="model was already prepared"):
                par.prepare(again)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        prepared = par.prepare(opt)
        for again in (opt, prepared):
            with pytest.raises(UsageError, match="optimizer was already prepared"):
                par.prepare(again)
