"""The recipe's GPT trained under Ray Train, checkpointed, losing a worker then a host.

A Ray Train ``train_loop_per_worker``: ``Parallel`` adopts Ray's group; the
zoo's GPT (ModuleList blocks, tied head), AdamW with decay / no-decay groups,
warmup + cosine, clipping, a shuffled loader (``samples``, 22 unless given;
``global_batch``: that batch over all ranks, ``split_batches``, else 2 per
rank); a Checkpointer every 2 steps and ``par.log`` of the loss. Faults, each
on the attempt it names (Ray restarts the group after each):
- ``kill_at``: on the first attempt, the last rank dies (``os._exit``) once
  that step is done;
- ``stop_at`` (with ``stop_pid``, ``stop_ip``): on a resumed attempt, the
  workers on host ``stop_ip`` stop that host's Ray node (SIGTERM to its ``ray
  start --block``) once that step is done: the host is gone, and an elastic
  group restarts smaller;
- ``snapshot_at``: every rank gathers the parameters after that step; rank 0
  saves them to ``out``/snapshot-from-FIRST-world-W.pt (FIRST: the step the
  attempt resumed from), to compare a resumed attempt with an uninterrupted run.
With ``equal``, the first attempt first runs the recipes of
tests/helpers/recipes.py under ddp and fsdp (:func:`record_equal`).
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
                if state.step == config.get("snapshot_at"):
                    _snapshot(par, model, first, out)
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
    """The faults ``config`` asks for at this step of this attempt (see the module)."""
    if step == config.get("kill_at") and first == 0 and par.rank == par.world_size - 1:
        (out / "killed").touch()  # the last rank dies, as an OOM kill would
        os._exit(1)
    if step == config.get("stop_at") and first > 0:
        import ray

        if ray.util.get_node_ip_address() == config["stop_ip"]:
            (out / "host-stopped").touch()
            with contextlib.suppress(ProcessLookupError):  # the other worker there sent it
                os.kill(int(config["stop_pid"]), signal.SIGTERM)
            time.sleep(120)  # the node's shutdown ends this worker
            os._exit(1)


def _snapshot(par: Parallel, model: torch.nn.Module, first: int, out: Path) -> None:
    """The whole parameters now (a collective), saved by rank 0, named by the attempt."""
    params = full_params(par.unwrap(model))
    if par.is_main:
        torch.save(params, out / f"snapshot-from-{first}-world-{par.world_size}.pt")


def record_equal(out: str) -> None:
    """Each worker trains the recipe's GPT under ddp and fsdp in Ray's group and saves
    ``out``/STRATEGY-rankR.pt: the whole parameters, the world, Ray's node rank and
    the worker's IP; rank 0 then marks ``out``/done (a restarted group skips this)."""
    import ray
    import torch.distributed as dist
    from recipes import Recipe, train_parallel

    context = ray.train.get_context()
    for strategy in ("ddp", "fsdp"):
        (result,) = train_parallel([Recipe("gpt")], {"strategy": strategy, "timeout_s": 60})
        record = {
            "world": dist.get_world_size(),
            "node": context.get_node_rank(),
            "ip": ray.util.get_node_ip_address(),
            "params": result.get("params"),
            "data_world": result.get("data_world"),
            "error": result.get("error"),
        }
        torch.save(record, os.path.join(out, f"{strategy}-rank{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        Path(out, "done").touch()


def in_ray(config: dict[str, Any]) -> None:
    """:func:`train` as Ray's loop (Ray returns no tensors; rank 0 saved them), after
    :func:`record_equal` on the first attempt when ``config["equal"]`` names its
    directory; what the workers printed goes to ``out``/said.txt (the attempt that
    ends writes it)."""
    equal = config.get("equal")
    if equal and not Path(equal, "done").exists():
        record_equal(equal)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        train(config)
    with open(Path(config["out"]) / "said.txt", "a") as fh:
        fh.write(said.getvalue())
