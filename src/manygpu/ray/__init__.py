"""Run a manygpu training function or script on a Ray cluster, through Ray Train.

The Ray-native form needs nothing from here: a ``train_loop_per_worker`` that
uses ``Parallel`` runs unchanged under ``TorchTrainer`` (Ray forms the group,
``Parallel`` adopts it; committed ``Checkpointer`` steps and ``par.log`` values
reach Ray: :mod:`manygpu.runtime.ray_train`). :func:`run` is the short form for
a user who starts from a manygpu script::

    result = manygpu.ray.run("train.py", args=["--epochs", "3"], num_workers=8, use_gpu=True)
    result = manygpu.ray.run(train_fn, num_workers=4, config={"lr": 1e-3})
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from manygpu.errors import UsageError
from manygpu.runtime.ray_train import pointed_to

__all__ = ["checkpoint_path", "run"]

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
    num_workers: int,
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
    a local one. ``max_failures``: times Ray restarts the worker group after a
    worker dies (``Checkpointer.resume()`` then starts from the last step).
    """
    train = _ray_train()
    from ray.train.torch import TorchTrainer

    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise UsageError(f"num_workers must be an integer >= 1, got {num_workers!r}")
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
