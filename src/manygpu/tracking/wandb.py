"""``log_with="wandb"``: a Weights & Biases run (``pip install 'manygpu[wandb]'``).

The run's id is manygpu's; a resumed job calls ``wandb.init(id=..., resume="allow")``.
Files go under ``<run_dir>/<run_id>/wandb``; ``WANDB_MODE=offline`` keeps them
there for ``wandb sync``; the project is ``WANDB_PROJECT``'s.
W&B cannot be asked offline which steps a run holds,
so the tracker records the last step it had handed over at each checkpoint; a
resumed run logs from the step after it (W&B refuses steps that go back). Offline,
W&B's service writes a run's records when the run finishes: a job killed with
``kill -9`` loses what that offline run held (online, the server has it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from manygpu.tracking.base import RunInfo, last_step_file, read_last_step

NAME = "wandb"


class WandbTracker:
    """One W&B run, as an object (``wandb.init`` returns it; no global ``wandb.log``)."""

    def __init__(self, info: RunInfo) -> None:
        import wandb

        home = info.home / "wandb"
        home.mkdir(parents=True, exist_ok=True)
        self._marker = last_step_file(info.home, NAME)
        self._held = read_last_step(self._marker) if info.resumed_at is not None else -1
        self._last = self._held
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
        self._last = step

    def run_key(self) -> str | None:
        return None

    def flush(self) -> None:
        """A checkpoint is saved: what it counts as logged is what a resume skips."""
        self._marker.write_text(str(self._last))

    def close(self) -> None:
        self._run.finish()


def open_run(info: RunInfo) -> WandbTracker:
    return WandbTracker(info)
