"""A job started the way srun or mpirun starts it, without ``manygpu launch``.

argv: OUT, WHAT. ``group``: the default group (manygpu's runtime), an all-reduce;
``ps``: a parameter server's links (rank 0 serves, rank 1 works), one message.
Each rank writes OUT/ready<rank> once its group is up, waits for OUT/go (at most
60 s), checks a result against the one it expects and writes it to OUT/done<rank>.
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from manygpu.runtime.cluster import detect_cluster
from manygpu.runtime.process_group import init_distributed, teardown

out, what = Path(sys.argv[1]), sys.argv[2]
cluster = detect_cluster()
if what == "group":
    ctx = init_distributed(cluster, device=torch.device("cpu"), backend="gloo", timeout_s=60)
else:
    from manygpu.strategies.ps.links import join

    ctx = join(cluster, 1, device=torch.device("cpu"), backend="gloo", timeout_s=60)
(out / f"ready{cluster.rank}").write_text(cluster.source)
deadline = time.monotonic() + 60
while not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
if what == "group":
    total = torch.tensor([float(cluster.rank + 1)])
    dist.all_reduce(total)
    result = float(total)  # 1 + 2
else:
    link = ctx.links[1 - cluster.rank]  # type: ignore[attr-defined]
    value = torch.tensor([3.0 if cluster.rank == 1 else 0.0])
    work = link.send(value) if cluster.rank == 1 else link.recv(value)
    link.wait(work, "the test message", 60)
    result = float(value)
(out / f"done{cluster.rank}").write_text(str(result))
teardown(ctx)
