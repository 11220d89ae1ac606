"""The job's one run: its id, its trackers (main rank only), and its place in checkpoints.

Trackers open at the first log call, not when ``Parallel`` is built, so a
checkpoint resumed before it (:meth:`TrackingRun.resume`) decides which run
they open: the stored one, continued, or a new one. What can fail without
training is checked when ``Parallel`` is built (:meth:`TrackingRun.preflight`).
Every rank keeps the step count (so ``step=None`` numbers calls alike
everywhere); only the main rank opens trackers and writes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from manygpu.runtime import env as envmod
from manygpu.tracking.base import RunInfo, Tracker
from manygpu.tracking.registry import check_installed, check_store, open_tracker
from manygpu.warn import warn_user

Describe = Callable[[], dict[str, Any]]
"""The job's resolved configuration, asked for once, when a new run opens (main rank)."""

_UNDER_RUN = ("tensorboard", "jsonl", "wandb")
"""Trackers that write under ``<run_dir>/<run_id>/`` (wandb in its ``wandb`` folder)."""


def where_text(names: tuple[str, ...], run_dir: str | Path, run_id: str) -> str:
    """Where run ``run_id`` of trackers ``names`` goes, and how to look at it: one
    sentence shared by the line a run prints when it opens and the demo's last line,
    so a script's user learns it as the demo's does.

    >>> where_text(("tensorboard", "jsonl"), "runs", "ab12")
    'tensorboard, jsonl in runs/ab12/ (see it: tensorboard --logdir runs)'
    """
    parts = []
    local = [n for n in names if n in _UNDER_RUN]
    if local:
        parts.append(f"{', '.join(local)} in {Path(run_dir) / run_id}/")
    if "mlflow" in names:
        uri = envmod.mlflow_tracking_uri(envmod.current())
        parts.append(f"mlflow at {uri or Path(run_dir) / 'mlruns'}")
    text = "; ".join(parts)
    if "tensorboard" in names:
        text += f" (see it: tensorboard --logdir {run_dir})"
    return text


def _print_now(line: str) -> None:
    print(line, flush=True)  # before the step's own output, under a launcher's pipes too


class TrackingRun:
    """Trackers ``names`` writing run ``run_id`` under ``run_dir``."""

    def __init__(
        self,
        names: tuple[str, ...],
        run_dir: str | Path,
        *,
        is_main: bool,
        describe: Describe,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """``say``: how the main rank prints the one line naming where the run goes
        (a script with ``log_with`` would otherwise never learn where its records went)."""
        self.names, self.run_dir, self.is_main = names, Path(run_dir), is_main
        self._describe, self._say = describe, say or _print_now
        self.run_id = uuid.uuid4().hex[:16]
        """The run's id; a resume replaces it with the stored one (main rank's counts)."""
        self.last_step = 0
        """The last step logged (0: none yet); ``step=None`` logs the next one."""
        self._resumed_at: int | None = None
        self._ids: dict[str, str] = {}
        self._trackers: dict[str, Tracker] | None = None

    def preflight(self) -> None:
        """Fail now, in one line, on what would fail at the first log: a missing extra
        (every rank), a store a tracker cannot open (the main rank, the one that writes)."""
        for name in self.names:
            check_installed(name)
        if self.is_main:
            for name in self.names:
                check_store(name, self.run_dir)

    def next_step(self, step: int | None, job_step: int | None = None) -> int:
        """The step of a log call: ``step``; else the job's training step when it is known
        and ahead of the last one logged, else the one after the last."""
        if step is not None:
            return step
        return self.last_step + 1 if job_step is None else max(job_step, self.last_step + 1)

    def write(self, values: Mapping[str, float], step: int) -> None:
        """Hand ``values`` to every tracker (main rank); every rank counts the step."""
        self.last_step = step
        if not self.is_main:
            return
        for tracker in self._open().values():
            tracker.log(values, step)

    def _open(self) -> dict[str, Tracker]:
        if self._trackers is None:
            info = RunInfo(
                run_id=self.run_id,
                run_dir=self.run_dir,
                config=self._describe() if self._resumed_at is None else {},
                resumed_at=self._resumed_at,
                ids=dict(self._ids),
            )
            self._trackers = {}
            for name in self.names:
                self._trackers[name] = open_tracker(name, info)
            verb = "continuing" if self._resumed_at is not None else "logging"
            where = where_text(self.names, self.run_dir, self.run_id)
            self._say(f"manygpu: {verb} run {self.run_id}: {where}")
        return self._trackers

    def state(self) -> dict[str, Any]:
        """What a checkpoint stores: the run's id, the trackers' own ids, the last step."""
        ids = dict(self._ids)
        for name, tracker in (self._trackers or {}).items():
            tracker.flush()  # what the checkpoint counts as logged is on disk
            key = tracker.run_key()
            if key is not None:
                ids[name] = key
        return {"run_id": self.run_id, "ids": ids, "last_step": self.last_step}

    def resume(self, saved: Mapping[str, Any] | None, *, step: int | None = None) -> None:
        """Continue the run a checkpoint of training step ``step`` stored (``None``: it
        stored none; a new run).

        The run continues after the later of the stored last step and ``step``: a job
        that logs after ``ckpt.after_step`` saved its checkpoint before logging that
        step, and the resumed job does not train (or log) that step again.
        """
        if step is not None:
            self.last_step = max(self.last_step, step)
        if not saved or not isinstance(saved.get("run_id"), str):
            return
        if self._trackers is not None:
            warn_user(
                "par.log was called before the checkpoint was resumed: the run it opened is "
                f"closed and run {saved['run_id']} continues; resume before the first log"
            )
            self.close()
        self.run_id = saved["run_id"]
        self.last_step = max(int(saved.get("last_step") or 0), step or 0)
        self._resumed_at = self.last_step
        self._ids = {str(k): str(v) for k, v in dict(saved.get("ids") or {}).items()}

    def close(self) -> None:
        """End every tracker's run (idempotent)."""
        trackers, self._trackers = self._trackers or {}, None
        for tracker in trackers.values():
            tracker.close()
