"""Iterable datasets under ``manygpu launch``: each rank writes what it read to OUT/rank-R.json.

``stream_launch.py CKPT OUT TOTAL KILL_TORCH KILL_HF``: trains on both streams
with checkpoints every 10 steps (rank 1 SIGKILLs itself after step KILL_TORCH
on the first attempt and after step KILL_HF on the second); then, on the
attempt that trained both to the end (once a job), reads two epochs of each
stream (an uninterrupted run's first TOTAL steps are their first TOTAL
batches: TOTAL is less than two epochs), trains on the unshuffled fallback
stream for the one-process comparison, and tries a stream whose order differs
between ranks. Every loader starts its own worker processes on each pass, so
nothing is read twice.
"""

import json
import os
import sys

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


attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
result: dict[str, object] = {"attempt": attempt}
with Parallel(strategy="ddp", timeout_s=60) as par:
    for kind, kill, on in (("torch", kill_torch, 0), ("hf", kill_hf, 1)):
        seen = stream_job.train(
            par, kind, os.path.join(ckpt, kind), int(total), every=10, kill_at=int(kill), attempt=on
        )
        # Written at once: a later stream's kill ends this attempt before the summary.
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
