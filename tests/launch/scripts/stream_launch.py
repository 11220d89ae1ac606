"""Iterable datasets under ``manygpu launch``: each rank writes what it read to OUT/rank-R.json.

``stream_launch.py CKPT OUT TOTAL KILL_TORCH KILL_HF``: trains on both streams
at once, step for step, the hf stream KILL_HF - KILL_TORCH steps ahead, with
checkpoints every 10 steps; on the first attempt rank 1 SIGKILLs itself after
the torch stream's step KILL_TORCH, the hf stream's KILL_HF (one kill, one
restart, both streams resumed: one mid-epoch, one in its second epoch). Then,
on the attempt that trained both to the end (once a job), reads two epochs of each
stream (an uninterrupted run's first TOTAL steps are their first TOTAL
batches: TOTAL is less than two epochs), trains on the unshuffled fallback
stream for the one-process comparison, and tries a stream whose order differs
between ranks. Every loader starts its own worker processes on each pass, so
nothing is read twice.
"""

import json
import os
import signal
import sys
from typing import Any

import stream_job
import torch
from reference import flat_params, make_model
from torch import nn
from torch.utils.data import DataLoader

from manygpu import Parallel
from manygpu.errors import UsageError

BATCH, WORKERS = 8, 2
ckpt, out, total, kill_torch, kill_hf = sys.argv[1:6]


class Unseeded(stream_job.Numbers):
    """Shuffled by each process's own random state: another order on every rank."""

    def __init__(self) -> None:
        super().__init__(16, shuffle=False)
        self.perm = torch.randperm(16).tolist()

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in self.perm:
            yield i, self.x[i], self.y[i]


def train_fallback(par: Parallel) -> list[float]:
    """One epoch of SGD under ddp on the unshuffled stream (BATCH per rank)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(stream_job.Numbers(shuffle=False), batch_size=BATCH, num_workers=WORKERS)
    model, opt, data = par.prepare(model, opt, data)
    for _, x, y in data:
        par.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return flat_params(par.unwrap(model)).tolist()


def train_both(par: Parallel, total: int, kill_torch: int, kill_hf: int) -> dict[str, Any]:
    """Both streams to step ``total``, the hf one ``kill_hf - kill_torch`` steps ahead;
    per stream, what each step read on this rank."""
    ahead = kill_hf - kill_torch if kill_torch > 0 else 0
    runs = {kind: stream_job.steps(par, kind, os.path.join(ckpt, kind), total, every=10)
            for kind in ("torch", "hf")}  # fmt: skip
    seen: dict[str, dict[int, list[int]]] = {"torch": {}, "hf": {}}
    at = {"torch": -1, "hf": -1}  # the last step each stream took
    while runs:
        hf_turn = "hf" in runs and ("torch" not in runs or at["hf"] - ahead <= at["torch"])
        kind = "hf" if hf_turn else "torch"
        taken = next(runs[kind], None)
        if taken is None:  # this stream is at ``total``
            del runs[kind]
            continue
        at[kind], seen[kind][taken[0]] = taken
        if kind == "torch" and at[kind] == kill_torch and stream_job.killing(0, par):
            assert at["hf"] == kill_hf, at
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dies mid-epoch, once a job
    return seen


attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
result: dict[str, object] = {"attempt": attempt}
with Parallel(strategy="ddp", timeout_s=60) as par:
    trained = train_both(par, int(total), int(kill_torch), int(kill_hf))
    for kind, seen in trained.items():
        name = f"resumed-{kind}-attempt{attempt}-rank{os.environ['RANK']}.json"
        with open(os.path.join(out, name), "w") as fh:
            json.dump(seen, fh)
    for kind in ("torch", "hf"):
        epochs = stream_job.read_epochs(par, kind, BATCH, WORKERS, 2)
        steps = [batch for epoch in epochs for batch in epoch]
        assert len(steps) >= int(total), f"{kind}: two epochs are {len(steps)} steps"
        result[f"reference-{kind}"] = steps[: int(total)]  # what an uninterrupted run reads
        result[f"epochs-{kind}"] = epochs
    result["params"] = train_fallback(par)
    try:
        par.prepare(DataLoader(Unseeded(), batch_size=2))
        result["refused"] = None
    except UsageError as exc:
        result["refused"] = str(exc)
with open(os.path.join(out, f"rank-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(result, fh)
