"""``log_with="wandb"``: a Weights & Biases run (``pip install 'manygpu[wandb]'``).

The run's id is manygpu's; a resumed job calls ``wandb.init(id=..., resume="allow")``.
Files go under ``<run_dir>/<run_id>/wandb``; ``WANDB_MODE=offline`` keeps them
there for ``wandb sync``; the project is ``WANDB_PROJECT``'s.
A resumed run logs from the step after its checkpoint's. Offline, W&B's service
writes a run's records when the run finishes: a job killed with ``kill -9``
loses what that offline run held, and the resumed job's values fill those
steps. Online the server has the killed job's steps after the checkpoint and
refuses steps that go back (with a warning), so there they keep the killed
job's values, as in MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from manygpu.tracking.base import RunInfo

NAME = "wandb"


class WandbTracker:
    """One W&B run, as an object (``wandb.init`` returns it; no global ``wandb.log``)."""

    def __init__(self, info: RunInfo) -> None:
        import wandb

        home = info.home / "wandb"
        home.mkdir(parents=True, exist_ok=True)
        # The checkpoint's step, never a file written outside the checkpoint: what the
        # resumed model did is what the steps after it show.
        self._held = -1 if info.resumed_at is None else info.resumed_at
        self._run: Any = wandb.init(
            id=info.run_id,
            resume="allow",
            dir=str(home),
            config=dict(info.config) if info.resumed_at is None else None,
        )

    def log(self, values: Mapping[str, float], step: int) -> None:
        if step <= self._held:
            return
        self._run.log(dict(values), step=step)

    def run_key(self) -> str | None:
        return None

    def flush(self) -> None:
        """Nothing: W&B's service writes the run's records itself."""

    def close(self) -> None:
        self._run.finish()


def open_run(info: RunInfo) -> WandbTracker:
    return WandbTracker(info)
