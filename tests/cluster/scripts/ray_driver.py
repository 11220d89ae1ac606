"""A Ray Train driver on host 0 of a Ray cluster of emulated hosts.

Usage: RAY_ADDRESS OUT_DIR STRATEGY[,STRATEGY...]. A ``TorchTrainer`` of 4
workers (one CPU each: 2 per host) runs the recipe of tests/helpers/recipes.py
(the zoo's GPT with a ModuleList of blocks and a tied head, AdamW groups,
warmup + cosine, clipping, 22 samples) under each strategy; each worker writes
OUT_DIR/STRATEGY-rankR.pt: the whole parameters, the world, Ray's node rank and
the worker's IP.
"""

import os
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config: dict) -> None:
    import torch
    import torch.distributed as dist
    from recipes import Recipe, train_parallel

    context = ray.train.get_context()
    for strategy in config["strategies"]:
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


if __name__ == "__main__":
    address, out, strategies = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    ray.init(address=address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"],
                                       "OMP_NUM_THREADS": "1"}})  # fmt: skip
    trainer = TorchTrainer(
        loop,
        train_loop_config={"out": out, "strategies": strategies},
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=os.path.join(out, "ray")),
    )
    result = trainer.fit()
    sys.exit(0 if result.error is None else 1)
