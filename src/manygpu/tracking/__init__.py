"""Experiment tracking for :meth:`manygpu.Parallel.log`: one run per job, written by the main rank.

``Parallel(log_with=["tensorboard", "mlflow", "wandb", "jsonl"], run_dir="runs")``
opens each named tracker (:mod:`.registry`; each an optional extra imported only
when asked for) on the main rank. ``par.log(values, step=...)`` is collective:
every rank calls it, its values are reduced in one collective (:mod:`.reducer`),
and the main rank hands the result to every tracker of the run (:mod:`.run`).
The run's id and last step travel in checkpoints, so a resumed job — after a
kill, on another world size — continues the same run with the next step.
"""

from manygpu.tracking.base import RunInfo, Tracker
from manygpu.tracking.registry import TRACKERS, check_names
from manygpu.tracking.run import TrackingRun

__all__ = ["TRACKERS", "RunInfo", "Tracker", "TrackingRun", "check_names"]
