"""Activation checkpointing in one process: same gradients, less kept, as the planner says.

Tolerances (fp32, CPU): gradients and parameters after an Adam step within
1e-6 of the run without checkpointing (the recomputation repeats the same ops
on the same inputs; measured equal to the last bit), and buffers equal: the
resnet's BatchNorm running statistics move once a step, not again when its
blocks are recomputed (they moved twice, ~1e-3 off, before). The bytes a step keeps
for the backward within 15% of the planner's prediction (the planner counts
per-block pieces measured once; the allocation of a recomputed region differs
from its first run in views and small buffers).
"""

from __future__ import annotations

import copy
import gc
import io
import re
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from zoo import ZOO

from manygpu import ActivationCheckpointing, Parallel, ParallelConfig
from manygpu.errors import UsageError
from manygpu.plan import hardware, recompute
from manygpu.plan.desc import describe, transformer
from manygpu.plan.recommend import recommend
from manygpu.transforms.checkpointing import apply, checkpoint_blocks, parse

GRAD_TOL, PLAN_TOL = 1e-6, 0.15


def _step(name: str, mode: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, Any]]:
    """One Adam step: the gradients, the parameters after it, and the buffers."""
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build()
    with Parallel(strategy="single", activation_checkpointing=mode) as par:
        model = par.prepare(model)
        opt = par.prepare(torch.optim.Adam(model.parameters(), lr=1e-2))
        x, y = entry.data(4, torch.Generator().manual_seed(1))
        par.backward(entry.loss(model(x), y))
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        checkpointed = [m for m in model.modules() if getattr(m, "_manygpu_checkpointed", False)]
        assert bool(checkpointed) == (mode is not None), "checkpointing did not act"
        buffers = {k: b.clone() for k, b in model.named_buffers()}
        return grads, [p.detach().clone() for p in model.parameters()], buffers


@pytest.mark.parametrize("name", ["gpt", "hf_llama", "resnet"])
@pytest.mark.parametrize("mode", ["full", "selective", 2])
def test_single_trains_as_without_checkpointing(name: str, mode: Any) -> None:
    want_grads, want_params, want_buffers = _step(name, None)
    grads, params, buffers = _step(name, mode)
    for a, b in zip([*grads, *params], [*want_grads, *want_params], strict=True):
        assert (a - b).abs().max().item() <= GRAD_TOL
    # BatchNorm's running statistics (the resnet's) are updated once per step, as
    # without checkpointing, not again by the recomputation: equal, bit for bit.
    assert buffers.keys() == want_buffers.keys()
    for key, value in buffers.items():
        assert torch.equal(value, want_buffers[key]), f"{name} {mode}: buffer {key} differs"


def test_blocks_keep_their_names_and_state_dict_keys() -> None:
    model = ZOO["gpt"].build()
    keys = list(model.state_dict())
    blocks = checkpoint_blocks(model, ActivationCheckpointing(every=2))
    assert [type(b).__name__ for b in blocks] == ["Block"]  # blocks 0 of 2
    assert list(model.state_dict()) == keys
    assert checkpoint_blocks(model, ActivationCheckpointing(block_classes=("Block",))) != []


def test_the_latest_setting_wins_on_a_model_checkpointed_before() -> None:
    torch.manual_seed(0)
    model = ZOO["gpt"].build()
    fresh = copy.deepcopy(model)
    checkpoint_blocks(fresh, parse("selective"))  # type: ignore[arg-type]
    want = _kept_bytes("gpt", fresh, 4)
    with Parallel(strategy="single", activation_checkpointing="full") as par:
        model = par.prepare(model)
    assert _kept_bytes("gpt", model, 4) < want  # "full" keeps less than "selective"
    with Parallel(strategy="single", activation_checkpointing="selective") as par:
        model = par.prepare(model)
    assert _kept_bytes("gpt", model, 4) == want  # not "full" any more
    blocks = checkpoint_blocks(model, ActivationCheckpointing(every=2))
    assert [_checkpointed(b) for b in model.blocks] == [True, False]  # type: ignore[union-attr]
    assert blocks == [model.blocks[0]]  # type: ignore[index]
    apply(model, None, None)  # off: every block is its own class again
    assert not any(_checkpointed(m) for m in model.modules())
    base = type(ZOO["gpt"].build().blocks[0])  # type: ignore[index]
    assert all(type(b) is base for b in model.blocks)  # type: ignore[union-attr]


def test_a_checkpointed_model_pickles_whole_and_comes_back_checkpointed() -> None:
    torch.manual_seed(0)
    model = ZOO["gpt"].build()
    checkpoint_blocks(model, parse("selective"))  # type: ignore[arg-type]
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module, classes by reference
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [type(b) for b in loaded.blocks] == [type(b) for b in model.blocks]
    assert _kept_bytes("gpt", loaded, 4) == _kept_bytes("gpt", model, 4)
    x, _ = ZOO["gpt"].data(2, torch.Generator().manual_seed(1))
    assert torch.equal(loaded(x), model(x))


def _checkpointed(module: nn.Module) -> bool:
    return bool(getattr(type(module), "_manygpu_checkpointed", False))


def test_a_typo_is_one_line_with_the_nearest_mode() -> None:
    with pytest.raises(UsageError, match="did you mean 'full'"):
        ParallelConfig(activation_checkpointing="ful")
    with pytest.raises(UsageError, match="N >= 1"):
        ParallelConfig(activation_checkpointing=0)
    with pytest.raises(UsageError, match="every="):
        ActivationCheckpointing(every=0)
    assert parse(False) is None and parse(True) == ActivationCheckpointing()


class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_model_without_blocks_asks_for_block_classes() -> None:
    with pytest.raises(UsageError, match="block_classes"):
        checkpoint_blocks(nn.Linear(4, 4), ActivationCheckpointing())
    # No block container, or one of plain layers: checkpointing each Linear saved nothing,
    # so it is refused as the README says, before any layer changed class.
    for mlp in (_TwoLinear(), nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))):
        with pytest.raises(UsageError, match=r"has no blocks \(layers of layers") as info:
            Parallel(strategy="single", activation_checkpointing="full").prepare(mlp)
        assert "\n" not in str(info.value)
        assert not any(_checkpointed(m) for m in mlp.modules())
    with pytest.raises(UsageError, match="no module of class Nope"):
        checkpoint_blocks(ZOO["gpt"].build(), ActivationCheckpointing(block_classes=("Nope",)))


class _Alive(TorchDispatchMode):
    """Every op output of a forward, weakly: what is still alive after it is what the
    backward keeps, however it is kept (saved tensors, checkpoint inputs, the
    outputs selective checkpointing caches)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[Any, tuple[int, int]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs.append((weakref.ref(t), (s.data_ptr(), s.nbytes())))
        return out

    def bytes(self, params: set[int]) -> int:
        """Distinct storages still alive, weights (and their views) left out."""
        gc.collect()
        alive = {key for ref, key in self.refs if ref() is not None and key[0] not in params}
        return sum(size for _, size in alive)


def _kept_bytes(name: str, model: nn.Module, batch: int) -> int:
    entry = ZOO[name]
    x, y = entry.data(batch, torch.Generator().manual_seed(1))
    alive = _Alive()
    with alive:
        loss = entry.loss(model(x), y)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = alive.bytes(params) - loss.untyped_storage().nbytes()
    loss.backward()
    return kept


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_kept_bytes_drop_as_the_planner_predicts(name: str) -> None:
    entry, batch = ZOO[name], 4
    torch.manual_seed(0)
    model = entry.build()
    desc = describe(name, model, entry.data, entry.loss, sample_batch=batch)
    plain = _kept_bytes(name, model, batch)
    # The measure agrees with what autograd's saved-tensor hooks count without checkpointing.
    assert plain == pytest.approx(desc.activation_bytes_per_sample * batch, rel=0.05)
    for mode in ("full", "selective", 2):
        copied = copy.deepcopy(model)
        checkpoint_blocks(copied, parse(mode))  # type: ignore[arg-type]
        measured = _kept_bytes(name, copied, batch)
        predicted = recompute.cost(desc, mode).kept_bytes_per_sample * batch
        assert measured == pytest.approx(predicted, rel=PLAN_TOL), mode
        assert measured < plain


def test_the_planner_recommends_checkpointing_only_when_nothing_fits_without() -> None:
    desc = transformer("1.3B", parameters=1_300_000_000, layers=24, hidden=2048, seq_len=2048)
    one = hardware.preset("a100", gpus_per_node=1)
    roomy = recommend(desc, one, batch=8, precision="bf16")
    assert "activation_checkpointing" not in roomy.parallel_line
    tight = recommend(desc, replace(one, memory_gb=40), batch=24, precision="bf16")
    assert tight.parallel_line.endswith('activation_checkpointing="full")')
    chosen = next(c for c in tight.candidates if c.strategy == tight.strategy)
    assert chosen.activations_saved > 0 and chosen.extra_compute == pytest.approx(0.31, abs=0.02)
    assert recompute.cost(desc, "selective").extra_compute == 0.0


def test_fits_no_strategy_says_when_even_full_checkpointing_does_not_help() -> None:
    desc = transformer("1.3B", parameters=1_300_000_000, layers=24, hidden=2048, seq_len=2048)
    small = replace(hardware.preset("a100", gpus_per_node=1), memory_gb=16)
    with pytest.raises(UsageError) as raised:
        recommend(desc, small, batch=24, precision="bf16")
    message = str(raised.value)
    assert 'even with activation_checkpointing="full"' in message and "\n" not in message
    found = re.search(r"([\d.]+) GB per device with it \(([\d.]+) GB without\)", message)
    assert found is not None, message
    with_it, without = float(found[1]), float(found[2])
    assert with_it < without, message
    # A model whose blocks are unknown was never counted with checkpointing: no claim.
    bare = replace(desc, block_activation_bytes_per_sample=0.0)
    with pytest.raises(UsageError, match="fits no strategy") as raised:
        recommend(bare, small, batch=24, precision="bf16")
    assert "activation_checkpointing" not in str(raised.value)


def test_prepare_says_once_what_it_checkpointed(capsys: pytest.CaptureFixture[str]) -> None:
    """One line, counted by class, so a user sees whether those are the layers meant."""
    Parallel(strategy="single", activation_checkpointing="full").prepare(ZOO["gpt"].build())
    Parallel(strategy="single", activation_checkpointing=2).prepare(ZOO["gpt"].build())
    Parallel(strategy="single").prepare(ZOO["gpt"].build())  # off: nothing said
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "checkpointing" in ln]
    assert lines == [
        "manygpu: activation checkpointing ('full'): 2 Block",
        "manygpu: activation checkpointing ('full', every 2): 1 Block of 2 blocks",
    ]
