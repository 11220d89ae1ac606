"""The recipe's GPT, checkpointed, trained to ``total`` steps across interruptions.

A real layout (the zoo's GPT: ModuleList blocks, tied head), AdamW with decay /
no-decay groups, warmup + cosine, clipping, a shuffled loader over 22 samples
that divide by neither the world nor the batch, several epochs. Each run resumes
from the newest checkpoint; a SIGTERM or SIGUSR1 makes the Checkpointer save and
stop (and, under Slurm on SIGUSR1, requeue the job). Used under Slurm's real
requeues and, uninterrupted, on local gloo ranks as their reference.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from recipes import INIT_SEED, full_params
from torch.utils.data import DataLoader
from zoo import OPTIMIZERS, ZOO, dataset, warmup_cosine

from manygpu import Parallel
from manygpu.checkpoint import Checkpointer

SAMPLES, BATCH, CLIP = 22, 2, 0.3


def train_to(
    ckpt_dir: str,
    out: str,
    total: int,
    sleep_s: float,
    strategy: str = "fsdp",
    every: int = 0,
) -> dict[str, torch.Tensor]:
    """Train (resuming) to ``total`` steps under ``strategy``; rank 0 writes
    ``out``/losses-A.json and progress-A (A: Slurm's restart count) as it goes, and
    params.pt at the end. ``every``: also save every this many steps (0: only on a
    notice).

    fsdp by default: its resume is bitwise. Under ddp the first step after a resume
    sums gradients in another order (torch's DDP rebuilds its buckets after each
    process's first backward), so a resumed run differs in the last bits (2.4e-7
    after 24 steps of this recipe with two resumes)."""
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    entry = ZOO["gpt"]
    with Parallel(strategy=strategy, timeout_s=60) as par:
        torch.manual_seed(INIT_SEED)
        model = par.prepare(entry.build())
        opt = par.prepare(OPTIMIZERS["adamw"](model))
        data = DataLoader(dataset("gpt", SAMPLES), batch_size=BATCH, shuffle=True)
        loader = par.prepare(data)
        sched = warmup_cosine(opt, total)
        ckpt = Checkpointer(
            par,
            ckpt_dir,
            model=model,
            optimizer=opt,
            scheduler=sched,
            loader=loader,
            every=every,
        )
        state = ckpt.resume()
        losses: dict[int, float] = {}
        while state.step < total:
            for x, y in loader:
                loss = entry.loss(model(x), y)
                par.backward(loss)
                par.clip_grad_norm_(model, CLIP)
                opt.step()
                sched.step()
                opt.zero_grad()
                state.step += 1
                losses[state.step] = float(par.reduce(loss.detach(), "mean"))
                if par.is_main:
                    _record(Path(out), attempt, losses, state.step)
                ckpt.after_step(state)  # a notice: save, (requeue,) exit 0
                time.sleep(sleep_s)
                if state.step >= total:
                    break
        ckpt.close()
        params = full_params(par.unwrap(model))
        if par.is_main:
            torch.save(params, Path(out) / "params.pt")
        return params


def _record(out: Path, attempt: str, losses: dict[int, float], step: int) -> None:
    (out / f"losses-{attempt}.json").write_text(json.dumps(losses))
    (out / f"progress-{attempt}").write_text(str(step))
