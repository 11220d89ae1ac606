"""A real training recipe, run under ``Parallel`` on N ranks and in one plain process.

The recipe is what users write: a zoo model, an optimizer (AdamW with decay
and no-decay groups by default), warmup + cosine ``LambdaLR``, gradient
clipping, gradient accumulation, and a data set of 22 samples that divides
neither by the world size nor by the batch (the loader pads the last shard,
so the last global batch is smaller and the last accumulation cycle short).

The reference replays the same global batches in one process with plain
torch: for each step, the concatenation of every data shard's batch (the
``DistributedSampler`` that ``prepare`` installs decides them).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler
from zoo import OPTIMIZERS, ZOO, dataset, warmup_cosine

SAMPLES = 22
INIT_SEED = 1000  # rank r builds its model from INIT_SEED + r: replicas start different


@dataclass(frozen=True)
class Recipe:
    """One training run: which model, how it is optimised, how the data is cut."""

    model: str
    optimizer: str = "adamw"
    batch: int = 4  # per data shard
    accum: int = 1
    clip: float | None = 0.3
    epochs: int = 1
    samples: int = SAMPLES
    precision: str = "fp32"  # "bf16": autocast in both runs
    per_shard_forward: bool = False  # BatchNorm under ddp: each rank normalises its own batch
    parallel: dict[str, Any] = field(default_factory=dict)  # extra Parallel(...) keywords
    five_lines: bool = False
    """Build the optimizer and its scheduler on the model *before* prepare, and prepare
    model, optimizer and loader in one call (the README's five lines)."""
    empty: bool = False
    """Build the model under ``par.init_module()`` (parameters on the meta device): the
    reference is one process initialised the same way (by module, from seed 0)."""
    weights: bool = False
    """Build it empty and ``prepare(..., weights=file)``, the file holding the model the
    reference starts from (safetensors of the INIT_SEED build)."""


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> whole tensor (DTensor shards gathered), on the CPU."""
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().cpu().clone()
    return out


def train_parallel(recipes: list[Recipe], parallel: dict[str, Any]) -> list[dict[str, Any]]:
    """Run each recipe under ``Parallel(**parallel)`` on this rank; errors become data.

    One process group serves every recipe (each ``Parallel`` borrows it):
    re-creating groups on one port back to back races the rendezvous.
    """
    import torch.distributed as dist

    from manygpu import Parallel

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    results = []
    for recipe in recipes:
        par = Parallel(
            **parallel,
            **recipe.parallel,
            grad_accum_steps=recipe.accum,
            precision=recipe.precision,
        )
        try:
            results.append(_run(par, recipe))
        except Exception as exc:  # a refusal at prepare is an expected answer for some pairs
            results.append({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            par.close()
    return results


def _run(par: Any, recipe: Recipe) -> dict[str, Any]:
    entry = ZOO[recipe.model]
    torch.manual_seed(INIT_SEED + par.rank)  # different on purpose: prepare must fix it
    steps = _optimizer_steps(recipe, par.strategy.data_shard()[1])
    loader = DataLoader(dataset(recipe.model, recipe.samples), batch_size=recipe.batch)
    weights = weights_file(recipe, par.rank) if recipe.weights else None
    with par.init_module() if recipe.empty or recipe.weights else contextlib.nullcontext():
        model = entry.build()
    if recipe.five_lines:
        opt = OPTIMIZERS[recipe.optimizer](model)
        sched = warmup_cosine(opt, steps)
        model, opt, loader = par.prepare(model, opt, loader, weights=weights)
        initial = full_params(par.unwrap(model))
    else:
        model = par.prepare(model, weights=weights)
        initial = full_params(par.unwrap(model))
        opt = par.prepare(OPTIMIZERS[recipe.optimizer](model))
        loader = par.prepare(loader)
        sched = warmup_cosine(opt, steps)
    pipelined = hasattr(model, "is_last")  # PipelinedModel: forward and backward together
    norms, losses = [], []
    for _ in range(recipe.epochs):
        for x, y in loader:
            loss = model(x, target=y) if pipelined else entry.loss(model(x), y)
            par.backward(loss)
            losses.append(float(loss.detach()))
            if par.sync_gradients and recipe.clip is not None:
                norms.append(float(par.clip_grad_norm_(model, recipe.clip)))
            opt.step()
            if par.sync_gradients:
                sched.step()
            opt.zero_grad()
    return {
        "initial": initial,
        "params": full_params(par.unwrap(model)),
        "buffers": {k: b.detach().clone() for k, b in par.unwrap(model).named_buffers()},
        "norms": norms,
        "data_world": par.strategy.data_shard()[1],
        # Blocks that checkpoint themselves (activation_checkpointing acted on this rank).
        "checkpointed": sum(
            bool(getattr(type(m), "_manygpu_checkpointed", False))
            for m in par.unwrap(model).modules()
        ),
    }


def weights_file(recipe: Recipe, rank: int) -> str:
    """The reference's starting model as a safetensors file (this rank's own copy)."""
    from safetensors.torch import save_model

    torch.manual_seed(INIT_SEED)
    path = os.path.join(
        tempfile.mkdtemp(prefix="recipe-weights-"), f"{recipe.model}-{rank}.safetensors"
    )
    save_model(ZOO[recipe.model].build(), path)  # a tied weight is written once
    return path


def _empty_build(name: str) -> torch.nn.Module:
    """What ``init_module()`` + ``prepare`` make of model ``name``, in one process."""
    from manygpu.transforms.materialize import EmptyModules, empty_init, initialize, place

    with empty_init():
        model = ZOO[name].build()
    empty = EmptyModules.of(model)
    place(model, torch.device("cpu"))
    initialize(empty, 0)  # Parallel's default seed
    return model


def global_batches(recipe: Recipe, data_world: int) -> list[tuple[torch.Tensor, ...]]:
    """Per step, each data shard's batch as the prepared loader cuts it (shard order)."""
    ds = dataset(recipe.model, recipe.samples)
    shards = []
    for r in range(data_world):
        sampler = DistributedSampler(ds, num_replicas=data_world, rank=r, shuffle=False)
        idx = list(sampler)
        shards.append([idx[i : i + recipe.batch] for i in range(0, len(idx), recipe.batch)])
    return [
        tuple(ds.tensors[0][shard[s]] for shard in shards)
        + tuple(ds.tensors[1][shard[s]] for shard in shards)
        for s in range(len(shards[0]))
    ]


def _optimizer_steps(recipe: Recipe, data_world: int) -> int:
    per_epoch = math.ceil(math.ceil(recipe.samples / data_world) / recipe.batch)
    return recipe.epochs * math.ceil(per_epoch / recipe.accum)


def _step_loss(
    recipe: Recipe, model: torch.nn.Module, parts: Any, shards: int, device: str = "cpu"
) -> torch.Tensor:
    """One global batch's loss: one forward over it, or one per shard (BatchNorm under ddp)."""
    entry = ZOO[recipe.model]
    parts = [p.to(device) for p in parts]
    xs, ys = parts[:shards], parts[shards:]
    with torch.autocast("cpu", torch.bfloat16, enabled=recipe.precision == "bf16"):
        if recipe.per_shard_forward:
            losses = [entry.loss(model(x), y) for x, y in zip(xs, ys, strict=True)]
            return torch.stack(losses).mean()
        return entry.loss(model(torch.cat(xs)), torch.cat(ys))


def reference_train(recipe: Recipe, data_world: int, device: str = "cpu") -> dict[str, Any]:
    """The recipe in one process, plain torch, on the same global batches (on ``device``:
    a GPU run compares with the same GPU's kernels, not the CPU's summation order)."""
    entry = ZOO[recipe.model]
    torch.manual_seed(INIT_SEED)  # rank 0's model: the one prepare broadcasts
    model = _empty_build(recipe.model) if recipe.empty and not recipe.weights else entry.build()
    initial = full_params(model)
    model.to(device)
    opt = OPTIMIZERS[recipe.optimizer](model)
    sched = warmup_cosine(opt, _optimizer_steps(recipe, data_world))
    norms = []
    for _ in range(recipe.epochs):
        steps = global_batches(recipe, data_world)
        cycles = [steps[i : i + recipe.accum] for i in range(0, len(steps), recipe.accum)]
        for cycle in cycles:
            for parts in cycle:
                (_step_loss(recipe, model, parts, data_world, device) / len(cycle)).backward()
            if recipe.clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return {"initial": initial, "params": full_params(model), "norms": norms}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over parameters present in both (names must match)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def titan_fsdp(model: torch.nn.Module, mesh: Any) -> None:
    """A user's own plan, as torchtitan's ``apply_fsdp`` writes it: each block of
    ``model.blocks`` a FSDP2 unit over the mesh's ``fsdp`` dimension, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh["fsdp"])
    fully_shard(model, mesh=mesh["fsdp"])
