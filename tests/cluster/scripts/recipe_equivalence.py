"""One host's share of a cross-host run of a real recipe, under each STRATEGY.

Usage: OUT_DIR STRATEGY[,STRATEGY...]. The recipe is tests/helpers/recipes.py's:
the zoo's GPT (token + position embeddings, a ModuleList of blocks, tied head),
AdamW with decay / no-decay groups, warmup + cosine, clipping, 22 samples that
divide by neither the world nor the batch. Each rank writes
OUT_DIR/STRATEGY-rankR.pt: the whole parameters, the world, its node, its host
name and the MASTER_ADDR its launcher gave it.
"""

import os
import sys

import torch
import torch.distributed as dist
from recipes import Recipe, train_parallel

out_dir, strategies = sys.argv[1], sys.argv[2].split(",")
for strategy in strategies:
    (result,) = train_parallel([Recipe("gpt")], {"strategy": strategy, "timeout_s": 60})
    record = {
        "world": dist.get_world_size(),
        "node": int(os.environ["GROUP_RANK"]),
        "params": result.get("params"),
        "data_world": result.get("data_world"),
        "error": result.get("error"),
        "host": os.uname().nodename,
        "master_addr": os.environ.get("MASTER_ADDR"),
    }
    torch.save(record, os.path.join(out_dir, f"{strategy}-rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
