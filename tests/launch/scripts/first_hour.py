"""A new user's mistakes, one per mode (argv[1]), run under ``manygpu launch``.

- ``typo``: every rank builds ``Parallel(strategy="fdsp")`` (a configuration error).
- ``alone``: each rank trains without ever joining a process group.
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
