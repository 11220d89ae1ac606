"""``precision="fp8"``: torchao's float8 training, with the defaults that matter.

Each eligible ``nn.Linear`` becomes torchao's ``Float8Linear`` before the
strategy wraps the model: its matmuls take float8 inputs and weights scaled
per tensor from their current amax (dynamic scaling), everything else runs in
bf16 autocast, and the weights and optimizer state stay in the user's dtype
(fp32), so a checkpoint holds the same keys and dtypes as without fp8.

What is kept out of float8, and why:

- the first and the last ``nn.Linear`` (in module order): the layers next to
  the embeddings and the logits are the ones whose precision the loss feels
  most, and the head is usually tied to the embedding, which float8 does not
  wrap;
- any ``nn.Linear`` whose in or out features are not a multiple of 16, which
  float8 matmuls (``torch._scaled_mm``) need.

Inner dimensions are padded (``pad_inner_dim``) so odd batch x sequence
shapes still run. Under FSDP2, weights are all-gathered in float8 and their
scales computed once per step (:mod:`manygpu.strategies.fsdp.fp8`).

Only GPUs with FP8 tensor cores run it (CUDA compute capability 8.9+: L4,
L40, RTX 40xx, H100, H200, B200); ``precision="auto"`` never picks it: it
changes the numerics, and on small layers the casts cost more than the faster
matmuls save (torchao's H100 tables: a linear with at most 4096 in and 1024
out features is slower in float8), so it is a choice the user makes and
measures. For tests,
``MANYGPU_FP8_EMULATE=1`` runs torchao's emulation (float8 numerics done in
ordinary matmuls) on any device, the CPU included: slow, for checking numerics only.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from manygpu.errors import UsageError

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

__all__ = [
    "Fp8Training",
    "TrainsFp8",
    "check_fp8_strategy",
    "fp8_ability",
    "planned_precision",
    "require_torchao",
]

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada Lovelace; Hopper is 9.0)."""
FP8_MULTIPLE = 16
"""Float8 matmuls need both dimensions of a weight to be multiples of this."""
EMULATE_VARIABLE = "MANYGPU_FP8_EMULATE"
INSTALL = "pip install 'manygpu[fp8]'"


# -- the ability: which strategies keep whole nn.Linear layers for torchao --------
# Strategies that keep each layer whole on a rank (one device, DDP) or shard it
# with FSDP2 (which torchao teaches to all-gather weights in float8) have it.
# Those that cut layers themselves (tensor parallel needs torchao's own float8
# styles), split the model into stages or send weights to servers do not, so
# precision="fp8" is refused there by name instead of training with layers
# torchao does not expect.


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


def check_fp8_device(
    device_type: str, capability: tuple[int, int] | None, *, emulate: bool
) -> None:
    """Refuse fp8 in one line where it cannot run: pure, tests pass any device's facts."""
    if emulate:
        return
    if device_type == "cuda" and capability is not None and capability >= FP8_CAPABILITY:
        return
    where = f"compute capability {capability[0]}.{capability[1]}" if capability else device_type
    raise UsageError(
        f"precision='fp8' needs a GPU with FP8 tensor cores (CUDA compute capability "
        f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+: L4, L40, RTX 40xx, H100), and this "
        f"device is {where}: use precision='bf16' ({EMULATE_VARIABLE}=1 emulates fp8 for "
        "tests: slow, a numerics check only)"
    )


def kept_linears(model: nn.Module) -> dict[str, str]:
    """The ``nn.Linear`` layers of ``model`` that stay in high precision, by name, with why."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    kept: dict[str, str] = {}  # in module order
    for i, (name, layer) in enumerate(linears):
        if layer.in_features % FP8_MULTIPLE or layer.out_features % FP8_MULTIPLE:
            kept[name] = f"dims {layer.in_features}x{layer.out_features} not multiples of 16"
        elif i == 0:
            kept[name] = "first linear layer"
        elif i == len(linears) - 1:
            kept[name] = "last linear layer"
    return kept


def require_torchao() -> None:
    """Raise :class:`UsageError` in one line naming the extra when torchao is missing."""
    _torchao_float8()


def _torchao_float8() -> Any:
    """torchao's float8 package, imported only when fp8 is asked for.

    torchao logs a warning for each optional kernel library its build lacks
    (CPU builds have none) and torch one about torchao's enum registration:
    noise on every rank for kernels fp8 training does not use, so those two
    loggers are quieted while it imports.
    """
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    try:
        for log in loggers:
            log.setLevel(logging.ERROR)
        import torchao.float8 as float8
    except ImportError as exc:
        raise UsageError(f"precision='fp8' needs torchao: {INSTALL}") from exc
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
    return float8


def float8_config(*, all_gather: bool, emulate: bool) -> Float8LinearConfig:
    """Dynamic tensorwise scaling (torchao's default recipe), inner dims padded."""
    float8 = _torchao_float8()
    return float8.Float8LinearConfig(
        enable_fsdp_float8_all_gather=all_gather, pad_inner_dim=True, emulate=emulate
    )


def convert(model: nn.Module, *, all_gather: bool, emulate: bool) -> list[str]:
    """Swap ``model``'s eligible linears for float8 ones in place; their names."""
    float8 = _torchao_float8()
    kept = kept_linears(model)
    float8.convert_to_float8_training(
        model,
        config=float8_config(all_gather=all_gather, emulate=emulate),
        module_filter_fn=lambda _module, fqn: fqn not in kept,
    )
    linear = float8.float8_linear.Float8Linear
    return [n for n, m in model.named_modules() if isinstance(m, linear)]


def check_some_float8(model: nn.Module, kept: dict[str, str], shown: int = 4) -> None:
    """Refuse in one line a model none of whose linears would be float8: it would
    train in bf16 under an fp8 name, paying for the conversion and gaining nothing."""
    total = sum(isinstance(m, nn.Linear) for m in model.modules())
    if total > len(kept):
        return
    said = [f"{name} ({why})" for name, why in list(kept.items())[:shown]]
    if len(kept) > shown:
        said.append(f"{len(kept) - shown} more")
    reasons = f" ({', '.join(said)})" if said else ""
    raise UsageError(
        f"precision='fp8': none of {type(model).__name__}'s {total} linear layers can run "
        f"in float8{reasons}, so this would be a bf16 job: use precision='bf16', or give it "
        f"linear layers whose in and out features are multiples of {FP8_MULTIPLE} between "
        "a first and a last one (those two always stay in bf16)"
    )


def conversion_line(converted: list[str], kept: dict[str, str], shown: int = 4) -> str:
    """``manygpu: precision='fp8': 11 of 13 linear layers in float8; kept in bf16: ...``."""
    said = [f"{name} ({why})" for name, why in list(kept.items())[:shown]]
    if len(kept) > shown:
        said.append(f"{len(kept) - shown} more")
    total = len(converted) + len(kept)
    line = f"manygpu: precision='fp8': {len(converted)} of {total} linear layers in float8"
    return line + (f"; kept in bf16: {', '.join(said)}" if said else "")


class Fp8Training:
    """A job's fp8: converts each prepared model and keeps the strategy told of steps."""

    def __init__(self, *, emulate: bool) -> None:
        self.emulate = emulate
        self._models: list[tuple[TrainsFp8, weakref.ref[nn.Module]]] = []

    def convert(self, model: nn.Module, strategy: object) -> str:
        """Convert ``model`` (before ``strategy`` wraps it); the line that says what became
        float8 and what stayed in bf16, and why. A model none of whose linears can be
        float8 is refused in one line."""
        strategy = fp8_ability(strategy)
        kept = kept_linears(model)
        check_some_float8(model, kept)
        names = convert(model, all_gather=strategy.fp8_all_gather, emulate=self.emulate)
        self._models.append((strategy, weakref.ref(model)))
        model.register_load_state_dict_post_hook(
            lambda module, _keys: strategy.fp8_after_load(module)
        )
        return conversion_line(names, kept)

    def after_step(self, step: int) -> None:
        """The step event's listener, after every optimizer's update (FSDP2 rescales then)."""
        for strategy, ref in self._models:
            model = ref()
            if model is not None:
                strategy.fp8_after_step(model)


class ToFloat8:
    """The model transform (:mod:`.pipeline`): a job's fp8 conversion under ``strategy``."""

    def __init__(self, training: Fp8Training, strategy: object) -> None:
        self._training, self._strategy = training, strategy

    @property
    def name(self) -> str:
        return "fp8"

    def convert(self, model: nn.Module) -> str | None:
        return self._training.convert(model, self._strategy)


def planned_precision(precision: str) -> str:
    """What the planner counts ``precision`` as: fp8 keeps fp32 weights and runs the
    rest in bf16, and the planner has no float8 rates, so it plans bf16."""
    return "bf16" if precision == "fp8" else precision
