"""Join the job, say so in OUT/ready<rank>, then wait for OUT/go (at most 60 s)."""

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo")
dist.barrier()
(out / f"ready{os.environ['RANK']}").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
