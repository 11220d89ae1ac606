"""Checkpointed training under ``manygpu launch``; rank 0 records losses and parameters.

``ckpt_launch.py CKPT OUT TOTAL EVERY KILL_AT SLEEP_S [NOTICE_CKPT]``: with
NOTICE_CKPT, the job then trains a new model from scratch, saving into
NOTICE_CKPT only on a notice, until one stops it (one job serves a kill and a
notice; ``started`` is written once that second run trains).
"""

import json
import os
import sys

import torch
from ckpt_job import train

from manygpu import Parallel

directory, out, total, every, kill_at, sleep_s = sys.argv[1:7]
notice_dir = sys.argv[7] if len(sys.argv) > 7 else None
with open(os.path.join(out, f"pid{os.environ['RANK']}"), "w") as fh:
    fh.write(str(os.getpid()))
started = os.path.join(out, "started")
# CKPT_STRATEGY / CKPT_WEIGHTS: another strategy, the model built empty and loaded.
strategy, weights = os.environ.get("CKPT_STRATEGY", "ddp"), os.environ.get("CKPT_WEIGHTS")
with Parallel(strategy=strategy, timeout_s=30) as par:
    losses, params = train(
        par,
        directory,
        int(total),
        int(every),
        kill_at=int(kill_at),
        sleep_s=0.0 if notice_dir else float(sleep_s),
        started=None if notice_dir else started,
        weights=weights,
    )
    if par.is_main:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with open(os.path.join(out, f"losses-{attempt}.json"), "w") as fh:
            json.dump(losses, fh)
        torch.save(params, os.path.join(out, "params.pt"))
    if notice_dir:
        train(par, notice_dir, 100_000, 0, sleep_s=float(sleep_s), started=started, weights=weights)
