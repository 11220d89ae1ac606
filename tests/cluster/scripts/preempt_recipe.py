"""Run tests/helpers/preempt_job.py's training (fsdp): CKPT_DIR OUT_DIR TOTAL SLEEP_S [EVERY].

EVERY: also save a checkpoint every this many steps (default 0: only on a notice).
"""

import sys

from preempt_job import train_to

every = int(sys.argv[5]) if len(sys.argv) > 5 else 0
train_to(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), every=every)
