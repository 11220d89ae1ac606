"""One run of ``bench/gpu_defaults.py``: one variant training one model in this process.

Every variant trains the same model (``manygpu.bench.nets``: GPT-2 124M / 355M,
ResNet-50, or their tiny CPU versions) on the same synthetic batches with
AdamW; only the set-up and the step differ, and those are the only
variant-specific code here. Each ``setup_*`` returns a :class:`Trainer` and
:func:`measure` times every variant alike: warm-up steps (compilation happens
there), then timed steps between two device synchronisations.

``--variant checkpoint`` times saving and loading the model and AdamW state
instead: ``torch.save`` / ``torch.load`` of the two state dicts against
manygpu's ``Checkpointer`` (blocking, and asynchronous: the stall is how long
``save()`` holds training up).

Writes a JSON object to ``--out``; run by the driver, or by hand::

    python bench/gpu_defaults_worker.py --variant manygpu --model gpt-tiny --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manygpu.bench import mfu, models, nets
from manygpu.bench.models import Workload
from manygpu.bench.train import steps_per_epoch

Batch = tuple[torch.Tensor, torch.Tensor]

MODELS: dict[str, Callable[[], Workload]] = {
    "gpt-124m": lambda: models.gpt(nets.GPT2_124M, "gpt-124m", 16),
    "gpt-355m": lambda: models.gpt(nets.GPT2_355M, "gpt-355m", 8),
    "resnet-50": lambda: dataclasses.replace(models.build("resnet", "full"), name="resnet-50"),
    "gpt-tiny": lambda: models.gpt(nets.GPT_TINY, "gpt-tiny", 16),
    "resnet-tiny": lambda: dataclasses.replace(
        models.build("resnet", "small"), name="resnet-tiny", batch=8
    ),
}
"""The models, by the names the driver uses."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What one run trains; the same for every variant of a model."""

    variant: str
    model: str
    batch: int | None
    """Samples per step; ``None``: the model's (16, 8, 128; 16 and 8 for the tiny ones)."""
    steps: int
    warmup: int
    ckpt_dir: str
    """Where the checkpoint variant writes (a fresh directory inside, removed after)."""


@dataclass
class Trainer:
    """A variant reduced to what the timing harness needs."""

    batches: Iterator[Batch]
    """Endless (x, y) batches, already on the device."""
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Forward, backward, optimizer step; returns the loss (not synchronised)."""
    precision: str
    """What the forward really ran in (``bf16``, ``fp16``, ``fp32``; TF32 noted)."""
    close: Callable[[], None] = lambda: None


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def dataset(w: Workload, batch: int, cfg: RunConfig) -> TensorDataset:
    """The same synthetic samples for every variant (seeded), at most ~512 MB of them."""
    gen = torch.Generator().manual_seed(1234)
    x, y = w.make_batch(batch, gen)
    per_batch = x.element_size() * x.numel() + y.element_size() * y.numel()
    n = steps_per_epoch(per_batch, cfg.warmup + cfg.steps)
    return TensorDataset(*w.make_batch(batch * n, gen))


def is_conv(w: Workload) -> bool:
    return mfu.has_convolutions(w.model)


def adamw(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, **kwargs)


# -- variants ------------------------------------------------------------------------
def setup_classic(w: Workload, batch: int, cfg: RunConfig) -> Trainer:
    """The 2018 recipe: fp32, ``nn.DataParallel``, plain AdamW, pageable blocking copies."""
    dev = device()
    model = nn.DataParallel(w.model.to(dev))
    opt = adamw(model.parameters())
    loader = DataLoader(dataset(w, batch, cfg), batch_size=batch, shuffle=True, drop_last=True)

    def batches() -> Iterator[Batch]:
        for x, y in endless(loader):
            yield x.to(dev), y.to(dev)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = w.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Trainer(batches(), step, "fp32")


def setup_hand(w: Workload, batch: int, cfg: RunConfig, compiled: bool) -> Trainer:
    """Ten lines of hand-tuning: TF32, bf16 autocast, fused AdamW, pinned non-blocking
    copies, channels_last for convolutions; optionally ``torch.compile``."""
    dev = device()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    fmt = torch.channels_last if is_conv(w) else torch.contiguous_format
    model = w.model.to(dev, memory_format=fmt)
    opt = adamw(model.parameters(), fused=True)
    forward: Callable[..., torch.Tensor] = torch.compile(model) if compiled else model
    loader = DataLoader(
        dataset(w, batch, cfg), batch_size=batch, shuffle=True, drop_last=True, pin_memory=True
    )

    def batches() -> Iterator[Batch]:
        for x, y in endless(loader):
            x = x.to(dev, non_blocking=True)
            yield (
                (x.contiguous(memory_format=fmt) if x.dim() == 4 else x),
                y.to(dev, non_blocking=True),
            )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = w.loss(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Trainer(batches(), step, "bf16")


def setup_manygpu(
    w: Workload, batch: int, cfg: RunConfig, options: dict[str, Any], user_compile: bool = False
) -> Trainer:
    """``Parallel(**options)`` preparing the same model, AdamW and loader as the classic
    recipe builds; the user's own ``torch.compile`` on top when asked."""
    from manygpu.bench.train import resolved_precision
    from manygpu.core.parallel import Parallel

    par = Parallel(**options)
    model = par.prepare_model(w.model)
    forward: Callable[..., torch.Tensor] = torch.compile(model) if user_compile else model
    opt = par.prepare_optimizer(adamw(model.parameters()))
    loader = DataLoader(dataset(w, batch, cfg), batch_size=batch, shuffle=True, drop_last=True)
    prepared = par.prepare_loader(loader)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = w.loss(forward(x), y)
        par.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    precision = resolved_precision(par)
    if precision == "fp32" and par.device.type == "cuda" and mfu.tf32_in_use(is_conv(w)):
        precision = "fp32 (TF32)"
    if par.precision_choice.precision == "fp8":  # autocast says bf16: the linears are float8
        precision = "fp8 (float8 linears, bf16 autocast)"
    return Trainer(endless(prepared), step, precision, par.close)


def setup_accelerate(w: Workload, batch: int, cfg: RunConfig) -> Trainer:
    """Hugging Face Accelerate: bf16 on a GPU, fp32 on the CPU."""
    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    acc = Accelerator(mixed_precision="bf16" if cuda else "no", cpu=not cuda)
    loader = DataLoader(dataset(w, batch, cfg), batch_size=batch, shuffle=True, drop_last=True)
    model, opt, loader = acc.prepare(w.model, adamw(w.model.parameters()), loader)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = w.loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Trainer(endless(loader), step, "bf16" if cuda else "fp32")


def setup_fabric(w: Workload, batch: int, cfg: RunConfig) -> Trainer:
    """Lightning Fabric on one device: bf16-mixed on a GPU, 32-true on the CPU."""
    try:
        from lightning_fabric import Fabric
    except ImportError:
        from lightning.fabric import Fabric  # type: ignore[no-redef]

    cuda = torch.cuda.is_available()
    fabric = Fabric(
        accelerator="cuda" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
    )
    model, opt = fabric.setup(w.model, adamw(w.model.parameters()))
    loader = DataLoader(dataset(w, batch, cfg), batch_size=batch, shuffle=True, drop_last=True)
    loader = fabric.setup_dataloaders(loader)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = w.loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Trainer(endless(loader), step, "bf16" if cuda else "fp32")


SETUPS: dict[str, Callable[[Workload, int, RunConfig], Trainer]] = {
    "classic": setup_classic,
    "hand": lambda w, b, c: setup_hand(w, b, c, compiled=False),
    "hand_compile": lambda w, b, c: setup_hand(w, b, c, compiled=True),
    "manygpu": lambda w, b, c: setup_manygpu(w, b, c, {}),
    "manygpu_bf16": lambda w, b, c: setup_manygpu(w, b, c, {"precision": "bf16"}),
    "manygpu_bf16_user_compile": lambda w, b, c: setup_manygpu(
        w, b, c, {"precision": "bf16"}, user_compile=True
    ),
    "manygpu_compile": lambda w, b, c: setup_manygpu(w, b, c, {"compile": True}),
    "manygpu_fp8": lambda w, b, c: setup_manygpu(w, b, c, {"precision": "fp8"}),
    "manygpu_ac_full": lambda w, b, c: setup_manygpu(
        w, b, c, {"precision": "bf16", "activation_checkpointing": "full"}
    ),
    "manygpu_ac_selective": lambda w, b, c: setup_manygpu(
        w, b, c, {"precision": "bf16", "activation_checkpointing": "selective"}
    ),
    "manygpu_off": lambda w, b, c: setup_manygpu(
        w, b, c, {"precision": "fp32-strict", "channels_last": False}
    ),
    "accelerate": setup_accelerate,
    "fabric": setup_fabric,
}
"""Variant name -> set-up; the driver's table of variants names the same keys."""


# -- measuring -------------------------------------------------------------------------
def measure(w: Workload, batch: int, cfg: RunConfig) -> dict[str, Any]:
    """Warm up, then time ``cfg.steps`` steps between two synchronisations."""
    flops = mfu.step_flops(w, batch, torch.device("cpu"))  # counted on meta: no memory
    torch.manual_seed(0)
    if torch.cuda.is_available():  # the peak of this run's steps, not of an earlier set-up
        torch.cuda.reset_peak_memory_stats()
    trainer = SETUPS[cfg.variant](w, batch, cfg)
    loss = torch.zeros(())
    try:
        for _ in range(cfg.warmup):
            loss = trainer.step(*next(trainer.batches))
        sync()
        start = time.perf_counter()
        for _ in range(cfg.steps):
            loss = trainer.step(*next(trainer.batches))
        sync()
        seconds = time.perf_counter() - start
        final = float(loss.detach().float())
        # What activation checkpointing saves: activations are most of the peak.
        peak_gb = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    finally:
        trainer.close()
    x, _ = w.make_batch(1, torch.Generator().manual_seed(0))
    per_sample = x.shape[1] if x.dim() == 2 and not x.is_floating_point() else 1
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = mfu.peak_tflops(name, "bf16")  # one reference peak per GPU: MFUs compare like rates
    return {
        "samples_per_s": batch * cfg.steps / seconds,
        "units_per_s": batch * per_sample * cfg.steps / seconds,
        "unit": "tokens" if per_sample > 1 else "samples",
        "seconds": seconds,
        "flops_per_step": flops,
        "peak_tflops": peak,
        "mfu": mfu.mfu(flops, cfg.steps / seconds, peak),
        "precision": trainer.precision,
        "final_loss": final,
        "peak_memory_gb": peak_gb,
    }


def _timed(fn: Callable[[], Any]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_checkpoint(w: Workload, batch: int, cfg: RunConfig) -> dict[str, Any]:
    """Seconds to save and load the model + AdamW state: torch.save / torch.load against
    manygpu's Checkpointer, blocking and asynchronous (the stall and the whole save)."""
    from manygpu.checkpoint import Checkpointer, TrainState
    from manygpu.core.parallel import Parallel

    root = Path(tempfile.mkdtemp(prefix="gpu-defaults-ckpt-", dir=cfg.ckpt_dir or None))
    with Parallel() as par, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        model = par.prepare_model(w.model)
        opt = par.prepare_optimizer(adamw(model.parameters()))
        x, y = (t.to(par.device) for t in w.make_batch(batch, torch.Generator().manual_seed(0)))
        par.backward(w.loss(model(x), y))
        opt.step()  # AdamW's state exists from here on
        plain = root / "torch.pt"
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        out: dict[str, Any] = {"torch_save_s": _timed(lambda: torch.save(state, plain))}
        out["bytes"] = plain.stat().st_size
        out["torch_load_s"] = _timed(lambda: torch.load(plain, map_location=par.device))
        for name, async_save in (("blocking", False), ("async", True)):
            ckpt = Checkpointer(
                par,
                root / name,
                model=model,
                optimizer=opt,
                keep=1,
                async_save=async_save,
                handle_signals=False,
            )
            start = time.perf_counter()
            ckpt.save(TrainState(step=1))
            out[f"{name}_stall_s"] = time.perf_counter() - start
            ckpt.wait()
            out[f"{name}_save_s"] = time.perf_counter() - start
            out[f"{name}_resume_s"] = _timed(ckpt.resume)
            ckpt.close()
    return out


def parse_args(argv: list[str] | None = None) -> tuple[RunConfig, Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, choices=[*SETUPS, "checkpoint"])
    p.add_argument("--model", required=True, choices=list(MODELS))
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args(argv)
    cfg = RunConfig(
        variant=ns.variant,
        model=ns.model,
        batch=ns.batch,
        steps=ns.steps,
        warmup=ns.warmup,
        ckpt_dir=ns.ckpt_dir,
    )
    return cfg, ns.out


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_args(argv)
    torch.manual_seed(0)  # the same initial weights for every variant
    w = MODELS[cfg.model]()
    batch = cfg.batch or w.batch
    run = measure_checkpoint if cfg.variant == "checkpoint" else measure
    result = {
        "variant": cfg.variant,
        "model": w.name,
        "parameters": w.parameters,
        "batch": batch,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        **run(w, batch, cfg),
    }
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
