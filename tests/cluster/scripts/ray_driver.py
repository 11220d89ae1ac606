"""A Ray Train driver on host 0 of a Ray cluster of emulated hosts: both jobs, one driver.

Usage: RAY_ADDRESS OUT_DIR STOP_PID STOP_IP. First a ``TorchTrainer`` of 4 workers (one CPU
each: 2 per host) runs the recipe of tests/helpers/recipes.py (the zoo's GPT
with a ModuleList of blocks and a tied head, AdamW groups, warmup + cosine,
clipping, 22 samples) under ddp and fsdp; each worker writes
OUT_DIR/equal/STRATEGY-rankR.pt: the whole parameters, the world, Ray's node
rank and the worker's IP. Then ``manygpu.ray.run`` runs tests/helpers/ray_job.py
on 4 workers with a Checkpointer in OUT_DIR/restart/ck (asynchronous saves
every 2 steps) and ``max_failures=1``; the last worker dies after step 5, Ray
restarts the group, which resumes. OUT_DIR/restart/result.json: what Ray's
``Result`` says (error, metrics, the step its checkpoint points to). Last (it
takes a host away), the same job elastic, ``num_workers=(2, 4)``: after step 5
the workers on host STOP_IP stop that host's Ray node (STOP_PID: its ``ray
start --block``), and Ray restarts the group on the 2 workers the cluster
still holds, which resume on world size 2 (OUT_DIR/elastic/).
"""

import json
import os
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import manygpu.ray

STRATEGIES = ("ddp", "fsdp")
TOTAL, KILL_AT = 8, 5
# Both restarted jobs: 24 samples (3 whole global batches of 8 per epoch on 4 or 2
# workers: a padded last batch would differ between the two) and the global batch.
DATA = {"samples": 24, "global_batch": 8}


def loop(config: dict) -> None:
    import torch
    import torch.distributed as dist
    from recipes import Recipe, train_parallel

    context = ray.train.get_context()
    for strategy in STRATEGIES:
        (result,) = train_parallel([Recipe("gpt")], {"strategy": strategy, "timeout_s": 60})
        record = {
            "world": dist.get_world_size(),
            "node": context.get_node_rank(),
            "ip": ray.util.get_node_ip_address(),
            "params": result.get("params"),
            "data_world": result.get("data_world"),
            "error": result.get("error"),
        }
        torch.save(record, os.path.join(config["out"], f"{strategy}-rank{dist.get_rank()}.pt"))


def equal(out: str) -> None:
    os.makedirs(out)
    trainer = TorchTrainer(
        loop,
        train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=os.path.join(out, "ray")),
    )
    assert trainer.fit().error is None


def restart(out: str, num_workers: int | tuple[int, int] = 4, **stop: object) -> None:
    from ray_job import in_ray

    os.makedirs(out)
    config = {"out": out, "ckpt": os.path.join(out, "ck"), "total": TOTAL, "kill_at": KILL_AT,
              "async_save": True, "strategy": "fsdp", **DATA, **stop}  # fmt: skip
    result = manygpu.ray.run(in_ray, num_workers=num_workers, config=config, max_failures=1,
                             storage_path=os.path.join(out, "ray"))  # fmt: skip
    record = {
        "error": None if result.error is None else str(result.error)[-3000:],
        "metrics": result.metrics,
        "checkpoint": manygpu.ray.checkpoint_path(result.checkpoint),
    }
    with open(os.path.join(out, "result.json"), "w") as fh:
        json.dump(record, fh)


def elastic(out: str, stop_pid: int, stop_ip: str) -> None:
    # Ray's controller first decides the new size from its resource view, which
    # lags the lost node by up to a tick (20 s): it may try 4 workers first and
    # wait this long for them before it asks again (60 s by default).
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "15"
    restart(out, num_workers=(2, 4), stop_pid=stop_pid, stop_ip=stop_ip)


if __name__ == "__main__":
    address, out = sys.argv[1], sys.argv[2]
    ray.init(address=address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"],
                                       "OMP_NUM_THREADS": "1"}})  # fmt: skip
    equal(os.path.join(out, "equal"))
    restart(os.path.join(out, "restart"))
    elastic(os.path.join(out, "elastic"), int(sys.argv[3]), sys.argv[4])
