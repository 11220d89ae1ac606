"""Each worker starts a child of its own, then sleeps: the child must not outlive the job."""

import os
import subprocess
import sys
import time

rank = os.environ["RANK"]
child = subprocess.Popen(["sleep", "300"])
with open(os.path.join(sys.argv[1], f"pidchild{rank}"), "w") as fh:
    fh.write(str(child.pid))
with open(os.path.join(sys.argv[1], f"pid{rank}"), "w") as fh:
    fh.write(str(os.getpid()))
time.sleep(120)
