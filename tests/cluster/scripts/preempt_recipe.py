"""Run tests/helpers/preempt_job.py's training (fsdp): CKPT_DIR OUT_DIR TOTAL SLEEP_S."""

import sys

from preempt_job import train_to

train_to(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
