"""A new user's mistakes, one per mode (argv[1]), run under ``manygpu launch``.

- ``typo``: every rank builds ``Parallel(strategy="fdsp")`` (a configuration error).
- ``alone``: each rank trains without ever joining a process group.
- ``show``: prints what ``Parallel()`` (naming nothing) became, and the gloo interface.
- ``wait DIR``: every rank waits in a barrier, forever, after writing ``DIR/started<R>``.
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

    with Parallel(strategy="ddp", timeout_s=600):
        open(os.path.join(sys.argv[2], f"started{os.environ['RANK']}"), "w").close()
        time.sleep(600)
elif mode == "show":
    from manygpu import Parallel

    with Parallel() as par:
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        print(f"rank {par.rank}: {par.strategy_name} {par.config.precision} {iface}")
