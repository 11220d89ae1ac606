"""A new user's mistakes, one per mode (argv[1]), run under ``manygpu launch``.

- ``typo``: every rank builds ``Parallel(strategy="fdsp")`` (a configuration error).
- ``alone``: each rank trains without ever joining a process group.
- ``wait DIR``: every rank builds ``Parallel()`` naming no strategy, prints what it became
  and the gloo interface, writes ``DIR/started<R>``, then waits forever.
"""

import os
import sys

mode = sys.argv[1]
if mode == "typo":
    from manygpu import Parallel

    Parallel(strategy="fdsp")
elif mode == "alone":
    import torch

    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    print(f"rank {os.environ['RANK']} trained on its own")
elif mode == "wait":
    import time

    from manygpu import Parallel

    with Parallel(timeout_s=600) as par:
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        print(f"rank {par.rank}: {par.strategy_name} {par.config.precision} {iface}", flush=True)
        open(os.path.join(sys.argv[2], f"started{par.rank}"), "w").close()
        time.sleep(600)
