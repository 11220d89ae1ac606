"""Checkpointed training under ``manygpu launch``; rank 0 records losses and parameters."""

import json
import os
import sys

import torch
from ckpt_job import train

from manygpu import Parallel

directory, out, total, every, kill_at, sleep_s = sys.argv[1:7]
with open(os.path.join(out, f"pid{os.environ['RANK']}"), "w") as fh:
    fh.write(str(os.getpid()))
# CKPT_STRATEGY / CKPT_WEIGHTS: another strategy, the model built empty and loaded.
strategy, weights = os.environ.get("CKPT_STRATEGY", "ddp"), os.environ.get("CKPT_WEIGHTS")
with Parallel(strategy=strategy, timeout_s=30) as par:
    losses, params = train(
        par,
        directory,
        int(total),
        int(every),
        kill_at=int(kill_at),
        sleep_s=float(sleep_s),
        started=os.path.join(out, "started"),
        weights=weights,
    )
    if par.is_main:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with open(os.path.join(out, f"losses-{attempt}.json"), "w") as fh:
            json.dump(losses, fh)
        torch.save(params, os.path.join(out, "params.pt"))
