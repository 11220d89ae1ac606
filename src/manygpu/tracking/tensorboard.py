"""``log_with="tensorboard"``: event files in ``<run_dir>/<run_id>/``.

Needs ``pip install 'manygpu[tensorboard]'``.

``tensorboard --logdir <run_dir>`` shows each run by its id. A resumed run
writes to the same directory with ``purge_step`` set to the step after the
checkpoint: TensorBoard then hides what the killed job logged after that
checkpoint, which the resumed job logs again, so no step appears twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from manygpu.tracking.base import RunInfo


class TensorBoardTracker:
    """A ``SummaryWriter`` on the run's directory."""

    def __init__(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if info.resumed_at is None else info.resumed_at + 1
        self._writer: Any = SummaryWriter(log_dir=str(info.home), purge_step=purge)
        if info.resumed_at is None:
            text = json.dumps(dict(info.config), indent=2, default=str)
            # Indented four spaces: TensorBoard renders text as markdown, this as code.
            self._writer.add_text("manygpu/config", "    " + text.replace("\n", "\n    "), 0)

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def run_key(self) -> str | None:
        return None

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_run(info: RunInfo) -> TensorBoardTracker:
    return TensorBoardTracker(info)
