"""The FP8 ability: a strategy whose model keeps whole ``nn.Linear`` layers for torchao.

``precision="fp8"`` swaps a model's ``nn.Linear`` layers for torchao's
``Float8Linear`` before the strategy wraps it (:mod:`manygpu.core.fp8`). That
works where the strategy keeps each layer whole on a rank (one device, DDP)
or shards it with FSDP2, which torchao teaches to all-gather weights in
float8. Strategies that cut layers themselves (tensor parallel needs torchao's
own float8 styles), split the model into stages or send weights to servers do
not have the ability, so ``precision="fp8"`` is refused there by name instead
of training with layers torchao does not expect.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from manygpu.errors import UsageError


class TrainsFp8:
    """Mixed into the strategies ``precision="fp8"`` runs with; the defaults fit a
    strategy that holds whole weights (nothing to do around the optimizer)."""

    fp8_all_gather: ClassVar[bool] = False
    """Whether weights travel in float8 in the strategy's all-gathers (FSDP2): the
    conversion then wraps them so FSDP2 casts before it gathers (half bf16's bytes)."""

    def fp8_after_step(self, module: nn.Module) -> None:
        """Called after every optimizer step on ``module`` (a converted, prepared model)."""

    def fp8_after_load(self, module: nn.Module) -> None:
        """Called after ``module.load_state_dict`` (a checkpoint replaced its weights)."""


def check_fp8_strategy(strategy_cls: type) -> None:
    """Raise :class:`UsageError` in one line when ``strategy_cls`` cannot train in fp8."""
    if not issubclass(strategy_cls, TrainsFp8):
        raise UsageError(_refusal(strategy_cls))


def fp8_ability(strategy: object) -> TrainsFp8:
    """``strategy`` as one that trains in fp8, else the same one-line refusal (a job
    checks its strategy's class first; this is for callers holding an instance)."""
    if isinstance(strategy, TrainsFp8):
        return strategy
    raise UsageError(_refusal(type(strategy)))


def _refusal(strategy_cls: type) -> str:
    name = getattr(strategy_cls, "name", strategy_cls.__name__)
    return (
        f"precision='fp8' does not work with strategy {name!r}: torchao's float8 layers "
        "need whole nn.Linear weights on each rank; use strategy 'single', 'ddp', 'zero1', "
        "'fsdp' or 'zero2', or precision='bf16'"
    )
