"""Inside a Ray Train worker: what manygpu hands to Ray, and what it takes back.

Ray Train's ``TorchTrainer`` starts the workers, sets ``RANK`` / ``WORLD_SIZE``
/ ``MASTER_ADDR`` ... and forms the process group before the user's
``train_loop_per_worker`` runs; ``Parallel`` adopts that group as it adopts
torchrun's. What Ray cannot see by itself is the job's progress, so:

- every committed ``Checkpointer`` step is reported to Ray
  (:func:`report_checkpoint`: ``ray.train.report`` on every worker; the main
  rank's checkpoint is a *pointer*, Ray's documented form for a checkpoint
  kept elsewhere: a directory of one file, ``manygpu.json``, naming the step's
  directory or URL, which Ray copies into its run storage; the step itself is
  never copied), with the newest ``par.log`` values (the mean over ranks, as
  every tracker gets them) as its metrics, so ``Result.checkpoint`` and
  ``Result.metrics`` are the job's (:func:`pointed_to` reads a pointer);
- ``Checkpointer.resume()`` starts from ``ray.train.get_checkpoint()`` when Ray
  restarted the worker group with one (:func:`restored_checkpoint`).

Nothing here imports Ray: a process that never imported ``ray.train`` is not
a Ray Train worker, and pays nothing.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

RAY_VERSION = "2.60.0"
"""The Ray release the ``manygpu[ray]`` extra pins and the tests run on."""

POINTER = "manygpu.json"
"""The one file of a checkpoint reported to Ray: ``{"path": STEP, "step": N}``."""

_latest: dict[str, float] = {}
"""The newest ``par.log`` values of this worker, sent with the next checkpoint."""


def _train() -> Any | None:
    """``ray.train`` when this process runs a Ray Train worker's loop, else None."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        train.get_context().get_world_rank()
    except Exception:  # Ray imported, but not inside a training worker
        return None
    return train


def active() -> bool:
    """Whether this process is a Ray Train worker (its loop is running)."""
    return _train() is not None


def note_metrics(values: dict[str, float]) -> None:
    """Keep ``par.log``'s values (already reduced over ranks) for the next report."""
    if active():
        _latest.update(values)


def report_checkpoint(step: int, where: str | None) -> None:
    """Report a committed step to Ray (collective: every worker calls it once per step).

    ``where``: the step's directory or URL on the main rank, None on the others
    (Ray takes one checkpoint per report; the main rank's names the whole step).
    """
    train = _train()
    if train is None:
        return
    metrics = {**_latest, "step": step}
    if where is None:
        train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="manygpu-ray-") as tmp:
        (Path(tmp) / POINTER).write_text(json.dumps({"path": where, "step": step}))
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(tmp))


def pointed_to(checkpoint: Any) -> str | None:
    """The step directory or URL a checkpoint reported by manygpu points to (None: it is
    not one of ours). Read as JSON and checked by structure; nothing else is read."""
    with checkpoint.as_directory() as where:
        file = Path(where) / POINTER
        if not file.is_file():
            return None
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            return None
    ok = isinstance(data, dict) and isinstance(data.get("path"), str)
    return data["path"] if ok else None


def restored_checkpoint() -> str | None:
    """The step directory or URL Ray restarted this worker group with, if any."""
    train = _train()
    if train is None:
        return None
    checkpoint = train.get_checkpoint()
    return None if checkpoint is None else pointed_to(checkpoint)


def started_line(timeout_s: float) -> str:
    """What a job started by Ray Train does without manygpu's launcher (said once)."""
    return (
        "manygpu: under Ray Train: Ray started the workers, so manygpu launch's hang "
        "watch and first-failure report are not running; a stuck collective still ends "
        f"after timeout_s={timeout_s:g}s naming its rank and operation, and Ray restarts "
        "the group as its FailureConfig says"
    )


def device() -> Any | None:
    """The GPU Ray Train gave this worker (``ray.train.torch.get_device()``), when it
    gave one; None otherwise (outside Ray, or on CPU workers)."""
    if _train() is None:
        return None
    torch_train = sys.modules.get("ray.train.torch")
    if torch_train is None:
        return None
    chosen = torch_train.get_device()
    return chosen if getattr(chosen, "type", "cpu") == "cuda" else None
