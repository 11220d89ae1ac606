"""Run with ``-m pkg.job``: proves module launching and argv handling."""

import os
import sys

out = sys.argv[1]
with open(os.path.join(out, f"module-rank{os.environ['RANK']}"), "w") as fh:
    fh.write(f"{__name__} {sys.argv[0]} {' '.join(sys.argv[1:])}")
