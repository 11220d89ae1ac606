"""``log_with="mlflow"``: an MLflow run (``pip install 'manygpu[mlflow]'``, mlflow-skinny).

The tracking server is ``MLFLOW_TRACKING_URI`` when set, else the file store
``<run_dir>/mlruns`` (which MLflow 3 opens only with ``MLFLOW_ALLOW_FILE_STORE=true``).
The experiment is ``MLFLOW_EXPERIMENT_NAME`` or ``manygpu``. MLflow chooses the
run's id; checkpoints store it, and a resumed job reopens that run
(``run_id=``). Steps the run already holds (logged after the checkpoint, before
the job died) are not logged again, so they keep the killed job's values:
MLflow keeps every value it is given and cannot replace one (the other trackers
show the resumed job's values there).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.tracking.base import RunInfo

NAME = "mlflow"
EXPERIMENT = "manygpu"


class MlflowTracker:
    """One MLflow run, written through an ``MlflowClient`` (no global active run)."""

    def __init__(self, info: RunInfo) -> None:
        from mlflow.tracking import MlflowClient

        environ = envmod.current()
        self._client: Any = _client(MlflowClient, _uri(info.run_dir))
        stored = info.ids.get(NAME)
        if stored:
            self._run_id = stored
            self._client.update_run(stored, status="RUNNING")
            self._held = _last_step(self._client, stored)
        else:
            experiment = envmod.mlflow_experiment(environ) or EXPERIMENT
            found = self._client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found else self._client.create_experiment(experiment)
            run = self._client.create_run(
                exp_id, run_name=info.run_id, tags={"manygpu.run_id": info.run_id}
            )
            self._run_id, self._held = run.info.run_id, -1
            self._log_config(info.config)

    def _log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, _param(v)) for k, v in config.items()]
        self._client.log_batch(self._run_id, params=params)
        self._client.log_text(
            self._run_id, json.dumps(dict(config), indent=2), "manygpu-config.json"
        )

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self._held:
            return
        now = int(time.time() * 1000)
        metrics = [Metric(_key(k), float(v), now, step) for k, v in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def run_key(self) -> str | None:
        return self._run_id

    def flush(self) -> None:
        """Nothing: every call above has reached the server when it returns."""

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def _uri(run_dir: Path) -> str:
    """``MLFLOW_TRACKING_URI``, else the file store ``<run_dir>/mlruns``."""
    return envmod.mlflow_tracking_uri(envmod.current()) or (run_dir / "mlruns").resolve().as_uri()


def check_store(run_dir: Path) -> None:
    """Open the store the run will use (``Parallel.__init__``, main rank): MLflow 3's
    refusal of its file store is one line then, before any training."""
    from mlflow.tracking import MlflowClient

    _client(MlflowClient, _uri(run_dir))


def _client(factory: Any, uri: str) -> Any:
    """The client; MLflow 3's refusal of its file store becomes one line saying what to set."""
    from mlflow.exceptions import MlflowException

    try:
        client = factory(tracking_uri=uri)
        client.search_experiments(max_results=1)  # opens the store now, not at the first log
    except MlflowException as exc:
        if "MLFLOW_ALLOW_FILE_STORE" not in str(exc):
            raise
        raise UsageError(
            f"log_with='mlflow': MLflow refuses its file store {uri} unless "
            "MLFLOW_ALLOW_FILE_STORE=true; set that, or MLFLOW_TRACKING_URI to your server"
        ) from None
    return client


def _last_step(client: Any, run_id: str) -> int:
    """The highest step any metric of the run holds (-1: none)."""
    keys = client.get_run(run_id).data.metrics
    steps = [m.step for key in keys for m in client.get_metric_history(run_id, key)]
    return max(steps, default=-1)


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:6000]  # MLflow's limit on a parameter's value


def _key(name: str) -> str:
    """MLflow allows letters, digits and ``_ - . / space`` in a metric's name."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


def open_run(info: RunInfo) -> MlflowTracker:
    return MlflowTracker(info)
