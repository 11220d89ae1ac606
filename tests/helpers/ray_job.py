"""The recipe's GPT trained under Ray Train, checkpointed, one worker killed once.

A Ray Train ``train_loop_per_worker``: ``Parallel`` adopts Ray's group; the
zoo's GPT (ModuleList blocks, tied head), AdamW with decay / no-decay groups,
warmup + cosine, clipping, a shuffled loader (``samples``, 22 unless given;
``global_batch``: that batch over all ranks, ``split_batches``, else 2 per
rank); a Checkpointer every 2 steps and ``par.log`` of the loss. With
``kill_at`` the last rank of the first attempt dies (``os._exit``) once that
step is done, and Ray restarts the group; with ``stop_pid`` too, the workers
on host ``stop_ip`` stop that host's Ray node (SIGTERM to its ``ray start
--block``) instead: the host is gone, and an elastic group restarts smaller.
The same function, uninterrupted under ``run_ranks``, is the reference.
Returns (and on rank 0 saves to ``out``/params.pt) the parameters.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from recipes import INIT_SEED, full_params
from torch.utils.data import DataLoader
from zoo import OPTIMIZERS, ZOO, dataset, warmup_cosine

from manygpu import Parallel
from manygpu.checkpoint import Checkpointer

SAMPLES, BATCH, CLIP = 22, 2, 0.3


def train(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    out, total = Path(config["out"]), int(config["total"])
    entry = ZOO["gpt"]
    split = bool(config.get("global_batch"))
    data = dataset("gpt", int(config.get("samples", SAMPLES)))
    with Parallel(strategy=config.get("strategy", "fsdp"), timeout_s=60,
                  split_batches=split) as par:  # fmt: skip
        torch.manual_seed(INIT_SEED)
        model = par.prepare(entry.build())
        opt = par.prepare(OPTIMIZERS["adamw"](model))
        batch = int(config["global_batch"]) if split else BATCH
        loader = par.prepare(DataLoader(data, batch_size=batch, shuffle=True))
        sched = warmup_cosine(opt, total)
        ckpt = Checkpointer(
            par, config["ckpt"], model=model, optimizer=opt, scheduler=sched, loader=loader,
            every=2, async_save=bool(config.get("async_save")),
        )  # fmt: skip
        state = ckpt.resume()
        first = state.step
        while state.step < total:
            for x, y in loader:
                loss = entry.loss(model(x), y)
                par.backward(loss)
                par.clip_grad_norm_(model, CLIP)
                opt.step()
                sched.step()
                opt.zero_grad()
                state.step += 1
                par.log({"loss": loss.detach()})
                ckpt.after_step(state)
                _maybe_die(config, par, state.step, first, out)
                if state.step >= total:
                    break
        ckpt.close()
        params = full_params(par.unwrap(model))
        if par.is_main:
            torch.save(params, out / "params.pt")
            (out / f"resumed-from-{first}").touch()
            (out / f"world-{par.world_size}").touch()
        return params


def _maybe_die(config: dict[str, Any], par: Parallel, step: int, first: int, out: Path) -> None:
    """The last rank of the first attempt dies after step ``kill_at`` (as an OOM kill would)."""
    if step != config.get("kill_at") or first != 0:
        return
    if config.get("stop_pid"):
        import ray

        if ray.util.get_node_ip_address() == config["stop_ip"]:
            (out / "host-stopped").touch()
            with contextlib.suppress(ProcessLookupError):  # the other worker there sent it
                os.kill(int(config["stop_pid"]), signal.SIGTERM)
            time.sleep(120)  # the node's shutdown ends this worker
            os._exit(1)
        return
    if par.rank == par.world_size - 1:
        (out / "killed").touch()
        os._exit(1)


def in_ray(config: dict[str, Any]) -> None:
    """:func:`train` as Ray's loop (Ray returns no tensors; rank 0 saved them); what
    the workers printed goes to ``out``/said.txt (the attempt that ends writes it)."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        train(config)
    with open(Path(config["out"]) / "said.txt", "a") as fh:
        fh.write(said.getvalue())
