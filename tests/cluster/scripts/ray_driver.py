"""A Ray Train driver on host 0 of a Ray cluster of emulated hosts: one job, three attempts.

Usage: RAY_ADDRESS OUT_DIR STOP_PID STOP_IP. ``manygpu.ray.run`` runs
tests/helpers/ray_job.py's loop, elastic (``num_workers=(1, 2)``,
``max_failures=2``), with a Checkpointer in OUT_DIR/ck (asynchronous saves
every 2 steps). The first attempt, on 2 workers (one CPU each: 1 per host),
first trains the recipe of tests/helpers/recipes.py (the zoo's GPT with a
ModuleList of blocks and a tied head, AdamW groups, warmup + cosine,
clipping, 22 samples) under ddp and fsdp (each worker writes
OUT_DIR/equal/STRATEGY-rankR.pt: the whole parameters, the world, Ray's node
rank and the worker's IP), then the job; its last worker dies after step 5.
Ray restarts the group on 2 workers, which resume and save their parameters
after step 6; after step 7 the worker on host STOP_IP stops that host's Ray
node (STOP_PID: its ``ray start --block``), and Ray restarts the group on the
worker the cluster still holds, which resumes on world size 1 and ends the
job. OUT_DIR/result.json: what Ray's ``Result`` says (error, metrics, the step
its checkpoint points to). One job, not three: each job starts its own Ray
Train controller actors and workers (~5 CPU-s a process).
"""

import json
import os
import sys

import ray

import manygpu.ray

TOTAL, KILL_AT, SNAPSHOT_AT, STOP_AT = 8, 5, 6, 7
# 24 samples (3 whole global batches of 8 per epoch on 2 workers or 1: a padded
# last batch would differ between the two) and the global batch.
DATA = {"samples": 24, "global_batch": 8}


def job(out: str, stop_pid: int, stop_ip: str) -> None:
    from ray_job import in_ray

    # Ray's controller first decides the new size from its resource view, which
    # lags the lost node by up to a tick (20 s): it may try 2 workers first and
    # wait this long for them before it asks again (60 s by default).
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "15"
    os.makedirs(os.path.join(out, "equal"))
    config = {"out": out, "ckpt": os.path.join(out, "ck"), "total": TOTAL, "kill_at": KILL_AT,
              "snapshot_at": SNAPSHOT_AT, "stop_at": STOP_AT, "stop_pid": stop_pid,
              "stop_ip": stop_ip, "equal": os.path.join(out, "equal"), "async_save": True,
              "strategy": "fsdp", **DATA}  # fmt: skip
    result = manygpu.ray.run(in_ray, num_workers=(1, 2), config=config, max_failures=2,
                             storage_path=os.path.join(out, "ray"))  # fmt: skip
    record = {
        "error": None if result.error is None else str(result.error)[-3000:],
        "metrics": result.metrics,
        "checkpoint": manygpu.ray.checkpoint_path(result.checkpoint),
    }
    with open(os.path.join(out, "result.json"), "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    address, out = sys.argv[1], sys.argv[2]
    ray.init(address=address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"],
                                       "OMP_NUM_THREADS": "1"}})  # fmt: skip
    job(out, int(sys.argv[3]), sys.argv[4])
