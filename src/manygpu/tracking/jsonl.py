"""``log_with="jsonl"``: one JSON object per line in ``<run_dir>/<run_id>/metrics.jsonl``.

Needs nothing installed. The first line of a new run is ``{"config": ...}``;
each log call is ``{"step": N, "time": ..., "values": {...}}``, flushed at once
so a killed job loses nothing it logged. A resumed run first drops the steps
after its checkpoint's (logged by the job that died; the file is rewritten
and renamed into place), then appends: those steps get the resumed job's
values, as in TensorBoard, and none appears twice.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from manygpu.tracking.base import RunInfo

FILE = "metrics.jsonl"


class JsonlTracker:
    """Appends to the run's JSONL file."""

    def __init__(self, info: RunInfo) -> None:
        info.home.mkdir(parents=True, exist_ok=True)
        path = info.home / FILE
        if info.resumed_at is not None and path.is_file():
            _drop_after(path, info.resumed_at)
        self._held = last_step_in(path)
        self._fh: IO[str] = path.open("a", encoding="utf-8")
        if path.stat().st_size and not _ends_with_newline(path):
            self._fh.write("\n")  # a line torn by a kill stays a line of its own
        if info.resumed_at is None and self._held < 0:
            self._write({"config": dict(info.config)})

    def _write(self, record: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def log(self, values: Mapping[str, float], step: int) -> None:
        if step <= self._held:
            return
        self._write({"step": step, "time": time.time(), "values": dict(values)})

    def run_key(self) -> str | None:
        return None

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read(path: Path) -> list[dict[str, Any]]:
    """The file's records (a line torn by a kill is skipped)."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def last_step_in(path: Path) -> int:
    """The highest step ``path`` holds (-1: none, or no file)."""
    if not path.is_file():
        return -1
    steps = [r["step"] for r in read(path) if isinstance(r.get("step"), int)]
    return max(steps, default=-1)


def _drop_after(path: Path, step: int) -> None:
    """Rewrite ``path`` without the records of steps after ``step`` (atomically: a kill
    mid-way leaves the old file)."""
    kept = [
        line for line in path.read_text(encoding="utf-8").splitlines() if not _after(line, step)
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return (
        isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step
    )


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as fh:
        fh.seek(-1, 2)
        return fh.read(1) == b"\n"


def open_run(info: RunInfo) -> JsonlTracker:
    return JsonlTracker(info)
