"""Read back what the trackers wrote, offline, through each tracker's own reader.

TensorBoard: its EventAccumulator (which applies purge_step as TensorBoard does).
MLflow: an MlflowClient on the file store. W&B: the records of each offline run's
``.wandb`` file (W&B's framed log of protobuf records, parsed with W&B's own
protobuf classes). JSONL: the lines.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768  # W&B's (leveldb-log) block size; a record's header is 7 bytes
_FULL, _LAST = 1, 4


def tensorboard(logdir: Path) -> dict[str, Any]:
    """{"scalars": {tag: [(step, value)]}, "texts": {tag: count}} as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    texts = {t: len(acc.Tensors(t)) for t in tags["tensors"]}
    return {"scalars": scalars, "texts": texts}


def mlflow_runs(uri: str) -> list[dict[str, Any]]:
    """Every run of every experiment: id, name, params and each metric's (step, value)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = []
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            rid = run.info.run_id
            history = {
                k: sorted((m.step, m.value) for m in client.get_metric_history(rid, k))
                for k in run.data.metrics
            }
            out.append({"id": rid, "name": run.info.run_name, "params": run.data.params,
                        "metrics": history})  # fmt: skip
    return out


def _records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST) and buf:
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def wandb_runs(root: Path) -> list[dict[str, Any]]:
    """Each offline run under ``root``: its id, config keys and history rows (step -> values)."""
    runs = []
    for file in sorted(root.rglob("run-*.wandb")):
        run: dict[str, Any] = {"id": None, "config": {}, "history": []}
        for r in _records(file):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run["id"] = r.run.run_id
                run["config"] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
            elif kind == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                       for i in r.history.item}  # fmt: skip
                run["history"].append(row)
        runs.append(run)
    return runs


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
