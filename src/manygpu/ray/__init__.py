"""Run a manygpu training function or script on a Ray cluster, through Ray Train.

The Ray-native form needs nothing from here: a ``train_loop_per_worker`` that
uses ``Parallel`` runs unchanged under ``TorchTrainer`` (Ray forms the group,
``Parallel`` adopts it; committed ``Checkpointer`` steps and ``par.log`` values
reach Ray: :mod:`manygpu.runtime.ray_train`). :func:`run` is the short form for
a user who starts from a manygpu script::

    result = manygpu.ray.run("train.py", args=["--epochs", "3"], num_workers=8, use_gpu=True)
    result = manygpu.ray.run(train_fn, num_workers=4, config={"lr": 1e-3})
    result = manygpu.ray.run(train_fn, num_workers=(2, 8), max_failures=3)  # elastic

Elastic (``num_workers=(min, max)``, Ray Train v2): when Ray restarts the group
with another number of workers (a node lost, or one added), the Checkpointer
resumes the last committed step on the new world size (the sharded state is
resharded, the loader keeps its place in global samples). With
``Parallel(split_batches=True)`` and the DataLoader's ``batch_size`` the global
batch, the optimizer sees the same batches on any world size.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from manygpu.errors import UsageError
from manygpu.runtime.ray_train import RAY_VERSION, pointed_to

__all__ = ["RAY_VERSION", "checkpoint_path", "run"]

EXTRA = "Ray Train is not installed; pip install 'manygpu[ray]'"


def _ray_train() -> Any:
    try:
        import ray.train.torch
    except ImportError as exc:
        raise UsageError(EXTRA) from exc
    import ray.train

    return ray.train


def run(
    target: Callable[..., Any] | str | Path,
    *,
    num_workers: int | tuple[int, int],
    use_gpu: bool = False,
    args: Sequence[str] = (),
    config: dict[str, Any] | None = None,
    storage_path: str | None = None,
    name: str | None = None,
    max_failures: int = 0,
) -> Any:
    """Train ``target`` on ``num_workers`` Ray Train workers; Ray's ``Result``.

    ``target``: a function (called with ``config`` when it takes an argument,
    as Ray calls ``train_loop_per_worker``) or a script's path (run as
    ``__main__`` in each worker with ``args`` as its ``sys.argv[1:]``). Ray is
    the one started by ``ray.init`` (or ``RAY_ADDRESS``) before this call, else
    a local one. ``num_workers``: a count, or ``(min, max)``: Ray Train v2's
    elastic group, started and restarted with as many workers as the cluster
    holds between the two. ``max_failures``: times Ray restarts the worker group
    after a worker dies (``Checkpointer.resume()`` then starts from the last
    step, on the new world size too).
    """
    check_workers(num_workers)
    train = _ray_train()
    from ray.train.torch import TorchTrainer

    loop, loop_config = _loop(target, list(args), config)
    trainer = TorchTrainer(
        loop,
        train_loop_config=loop_config,
        scaling_config=train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=train.RunConfig(
            storage_path=storage_path,
            name=name,
            failure_config=train.FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def check_workers(num_workers: object) -> None:
    """Refuse in one line what Ray's ``ScalingConfig`` would refuse later with a
    traceback, and 0 (Ray's local mode, which forms no group)."""
    values: tuple[object, ...] = (
        num_workers if isinstance(num_workers, tuple) and len(num_workers) == 2 else (num_workers,)
    )
    counts = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 1]
    if len(counts) != len(values) or counts != sorted(counts):
        raise UsageError(
            "num_workers must be an integer >= 1 or a (min, max) pair with "
            f"1 <= min <= max, got {num_workers!r}"
        )


def _loop(
    target: Callable[..., Any] | str | Path, args: list[str], config: dict[str, Any] | None
) -> tuple[Callable[..., Any], dict[str, Any] | None]:
    """Ray's ``train_loop_per_worker`` for ``target``, and its config."""
    if callable(target):
        return target, config
    script = Path(target)
    if not script.is_file():
        raise UsageError(f"no script at {script}; give a training script's path or a function")
    return _ScriptLoop(str(script.resolve()), args), config


class _ScriptLoop:
    """Runs a script as ``__main__`` in a Ray worker (picklable: a path and its argv)."""

    def __init__(self, script: str, args: list[str]) -> None:
        self.script, self.args = script, args

    def __call__(self) -> None:
        saved = sys.argv
        sys.argv = [self.script, *self.args]
        try:
            runpy.run_path(self.script, run_name="__main__")
        finally:
            sys.argv = saved


def checkpoint_path(checkpoint: Any) -> str | None:
    """Where the manygpu step a Ray ``Checkpoint`` points to lives (``Result.checkpoint``:
    a pointer, never a copy of the step); None when it is not manygpu's."""
    return None if checkpoint is None else pointed_to(checkpoint)
